# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what is missing, then runs.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# CPU machines pin torch to the CPU build; set CONSTRAINTS= on a GPU machine.
CONSTRAINTS ?= constraints/cpu.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed

.PHONY: install demo test lint up down status clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, so nothing later resolves it to a CUDA build
	$(BIN)/python -m pip install -q $(PIP_C) "torch==2.13.0"
	$(BIN)/python -m pip install -q $(PIP_C) -e ".[dev]"
	@touch $(STAMP)

demo: install
	$(BIN)/python -m deployments.demo

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

up: install
	$(BIN)/python -m deployments.local up

down:
	$(BIN)/python -m deployments.local down

status:
	$(BIN)/python -m deployments.local status
