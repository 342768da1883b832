# make demo  -- train a small Flax model data-parallel on 8 CPU devices, with and without compression
# make test  -- create .venv, install pinned dependencies, run the test suite
# make docs  -- build the documentation into site/ (mkdocs-material + mkdocstrings, --strict)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml requirements-lock.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements-lock.txt --config-settings editable_mode=compat -e '.[test,examples,docs]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/flax_nnx_train.py --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

lint: $(STAMP)
	$(BIN)/ruff check jaxcomp tests examples benchmarks
	$(BIN)/ruff format --check jaxcomp tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/wire_bytes.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache
