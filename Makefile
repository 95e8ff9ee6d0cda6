# Two commands set up a fresh machine by themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU torch first: an unpinned one would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m planner.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
