# kvroute developer commands. Everything runs inside .venv, which `make venv` builds.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test fuzz demo docs manifests bench bench-core bench-router bench-redis bench-disagg bench-compare compat lint fmt clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kvroute needs Python >= 3.10")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	@touch $(STAMP)

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

# Property-based tests and fuzzing with the long hypothesis profile (make test runs the
# same tests with a bounded one). About 10 minutes on 2 cores.
fuzz: venv
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/fuzz tests/unit/test_request_limits.py

demo: venv
	$(PY) -m router.demo

bench: venv bench-core bench-router bench-redis bench-disagg

bench-core: venv
	$(PY) -m router.bench.core

bench-router: venv
	$(PY) -m router.bench.overhead

bench-disagg: venv
	$(PY) -m router.bench.disagg

bench-redis: venv
	$(PY) -m router.bench.redis_index
	$(PY) -m router.bench.redis_decisions

# Peer routers (sglang-router, vllm-router) from PyPI, each in its own virtualenv under
# build/compat, routing to emulated engines on loopback. Not part of `make test`.
compat: venv
	$(PY) -m router.emulator.compat --build-dir build/compat

docs: venv
	$(PY) -m router.config --update docs/configuration.md

# deploy/manifests/<mode>/ from the Helm chart (helm binary, else Helm's Go SDK from the test extra).
manifests: venv
	$(PY) tests/support/deploy.py

# kvroute vs round robin vs sglang-router and vllm-router (installed from PyPI into
# build/compat when possible), each on 4 fresh emulated engines, on a reduced Mooncake
# replay and a multi-turn chat (about 15 minutes on 2 cores; docs/benchmarks.md).
bench-compare: venv
	$(PY) -m router.bench.compare

lint: venv
	$(VENV)/bin/ruff check router tests
	$(VENV)/bin/ruff format --check router tests

fmt: venv
	$(VENV)/bin/ruff check --fix router tests
	$(VENV)/bin/ruff format router tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
