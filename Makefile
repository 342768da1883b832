# make demo         -- train a small Flax model data-parallel on 8 CPU devices, with and without compression
# make test         -- create .venv, install the pinned test environment, run the test suite
#                      (its smoke subset at XLA's default CPU optimization level)
# make docs         -- build the documentation into site/ (mkdocs-material + mkdocstrings, --strict)
# make dist         -- build the sdist and the wheel into dist/
# make smoke-wheel  -- install the wheel into a fresh venv (no lock) and run the README quickstart
# make bench        -- the wire-bytes benchmark (every benchmark: python -m benchmarks.NAME --help)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The wheel's smoke test runs on the newest Python found (pip then resolves the newest jax for
# it); pyenv's shims of versions that are not selected fail to run, hence the check.
SMOKE_PYTHON ?= $(shell for p in python3.14 python3.13 python3.12 \
	$$(ls -d $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV) $(PYTHON); \
	do $$p -c 'import sys; print(sys.executable)' 2>/dev/null && break; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOKE_VENV := build/smoke-venv

.PHONY: demo test test-smoke-opt lint bench docs dist smoke-wheel clean

# uv (from PyPI, into the venv) installs the pinned set: the same 116 packages and versions
# as pip's resolver, in 10 s of CPU with an empty cache instead of pip's 44 s (and no pip
# upgrade first). Like pip's --no-compile, uv does not byte-compile what it installs; Python
# compiles only what a run imports, once, on first import. That needs bytecode writes on: a
# PYTHONDONTWRITEBYTECODE set in the caller's environment would make every one of the
# suite's processes recompile what it imports. uv reads no pip configuration (pip.conf's
# indexes, find-links): where it fails, pip installs the same lock.
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): pyproject.toml requirements-lock.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile uv==0.13.9 || echo 'no uv: pip installs the lock'
	$(BIN)/uv pip install -q --python $(BIN)/python -c requirements-lock.txt --config-setting editable_mode=compat -e '.[test,examples,docs,dist]' \
	  || $(BIN)/python -m pip install -q --no-compile -c requirements-lock.txt --config-settings editable_mode=compat -e '.[test,examples,docs,dist]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/flax_nnx_train.py --demo

# The suite compiles at XLA:CPU backend optimization level 0 (tests/conftest.py); its smoke
# subset (tests/test_smoke.py, marked smoke) runs at XLA's default level instead, the code
# users run. Collecting only that file: 60 s of CPU instead of 85 s (every worker imported
# every test module to find 12 tests).
# --dist loadscope keeps each test module on one worker, so a module's cached compiled steps
# (the contract suites' trajectories) are built once, not once per worker: the replicas'
# contract suite took 56 s of CPU instead of 73 s. --no-loadscope-reorder: modules go out in
# collection order, which tests/conftest.py sorts heaviest first (by measured CPU seconds).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder -m "not smoke" tests
	$(MAKE) test-smoke-opt

test-smoke-opt: $(STAMP)
	JAXCOMP_XLA_OPT_DEFAULT=1 $(BIN)/python -m pytest -q -n 2 -m smoke tests/test_smoke.py

lint: $(STAMP)
	$(BIN)/ruff check jaxcomp tests examples benchmarks docs/hooks
	$(BIN)/ruff format --check jaxcomp tests examples benchmarks docs/hooks

bench: $(STAMP)
	$(BIN)/python -m benchmarks.wire_bytes

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# build's isolated environment (setuptools) installed by the venv's uv: 11.0 s -> 6.0 s of CPU,
# the same wheel (its RECORD byte for byte).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --installer uv --outdir dist . || $(BIN)/python -m build --outdir dist .

smoke-wheel: dist
	rm -rf $(SMOKE_VENV)
	$(SMOKE_PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/python -m pip install -q --no-compile dist/jaxcomp-*.whl
	$(SMOKE_VENV)/bin/python tests/readme_quickstart.py --installed

clean:
	rm -rf $(VENV) .pytest_cache build dist
