# Two commands do everything on a fresh CPU machine:
#   make demo   installs into .venv and runs the CPU demo (2 Ray Train workers, MLflow run)
#   make test   installs if needed and runs the test suite (GPU tests skip without CUDA)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements/cpu.txt requirements/no-deps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements/no-deps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

demo: install
	$(BIN)/gemctl submit recipes/demo.yaml

# pytest exits 5 when it collects nothing (e.g. only GPU tests selected): not a failure.
# Two test processes (TEST_WORKERS=0 runs in one); a module's tests stay in one process, and
# the modules go out in the order tests/conftest.py gives them (longest first).
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) gem_data gem_runs mlflow.db mlflow.db.lock mlruns mlartifacts
