# Two commands set up a fresh machine by themselves: `make demo` and `make test`.
# `make check` runs the other checks CI runs: lint, types, the docs site, the built wheel.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TORCH := torch==2.13.0
SMOKE_VENV := build/smoke-venv

.PHONY: demo test test-models test-gpu setup check lint format typecheck docs docs-serve wheel wheel-smoke clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU torch first: an unpinned one would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The pinned tools of the `dev` and `docs` extras (ruff, mypy, build, pre-commit, mkdocs).
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,dev,docs]'
	touch $(DEV_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m planner.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The full matrix of real models (pytest -m models: every Hugging Face family, torchvision and
# timm models; about 75 minutes on 2 cores, too long for CI beside the suite). torchvision and
# timm go in without their dependencies (they would pull an unpinned, CUDA torch) and out again
# after: the only torchvision 0.28.0 wheel is a CUDA build, which breaks `import transformers`
# outside the tests' shim (the Hugging Face notebook of `make test`).
test-models: $(STAMP)
	$(BIN)/pip install --quiet --no-deps torchvision==0.28.0 timm==1.0.31
	$(BIN)/python -m pytest -q -m models; status=$$?; \
	$(BIN)/pip uninstall --quiet --yes torchvision timm; exit $$status

# The venv holds the CPU build of torch, so the CUDA tests run with PYTHON (default python3),
# whose torch must have CUDA; they fail, not skip, where it sees no GPU.
test-gpu:
	$(PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit(f'make test-gpu: {sys.executable} (torch {torch.__version__}) sees no CUDA device')"
	PYTHONPATH=. $(PYTHON) -m pytest -q -m cuda

check: lint typecheck docs wheel-smoke

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(DEV_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The site goes to build/site; --strict turns broken links and unresolved references into errors.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

docs-serve: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

wheel: $(DEV_STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# The wheel in a fresh virtualenv with the pinned CPU torch, used from outside the source tree.
wheel-smoke: wheel
	rm -rf $(SMOKE_VENV)
	$(BIN)/virtualenv --quiet $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/pip install --quiet $(TORCH)
	$(SMOKE_VENV)/bin/pip install --quiet dist/*.whl
	cd $(SMOKE_VENV) && bin/python $(CURDIR)/tools/smoke_wheel.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache build dist
