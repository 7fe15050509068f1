# ttrace: `make demo` and `make test` set everything up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast lint ui clean bench-tolerance bench-bugs bench-bugs-bf16 bench-perf bench-faults bench-suite nightly chromium

setup: $(STAMP)

# Re-run the install when the dependency list changes.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, by pip: it takes the local CPU wheel (pip's configuration) instead of a CUDA build.
	# Its bytecode is compiled below with the rest's (pip compiles on one core: 15 of its 23 s here).
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	# The rest by uv, which keeps that torch (==2.13.0 holds for 2.13.0+cpu): 4 s here where pip takes
	# 80. uv reads no pip configuration: where it cannot install (an index only pip knows), pip does.
	$(BIN)/pip install --quiet uv==0.13.9 && $(BIN)/uv pip install --quiet --python $(BIN)/python \
	    -e '.[dev,megatron,hf]' || $(BIN)/pip install --quiet --no-compile -e '.[dev,megatron,hf]'
	# Bytecode compiled now for what a check's and the suite's processes import (scripts/suite_imports.py:
	# 6,000 of the venv's 24,000 files), by importing it with bytecode writing on: left to the first
	# imports, every Ray worker starting at once compiles the same modules (the suite ran 35% longer;
	# where PYTHONDONTWRITEBYTECODE is set, as here, every process compiles what it imports, every time).
	# Beside it, the compiled kernels (numba) into tracer/kernels/__pycache__/ttrace-kernels-<digest of
	# their sources> (those of earlier sources removed), float32's (and the gathers) and float64's (each
	# kernel has cache files of its own; 22 s of one core per dtype here). Four processes at once on two
	# cores: 37 s here, where compileall of the whole venv (35 s) then the kernels (25 s) took 60.
	PYTHONDONTWRITEBYTECODE= $(BIN)/python scripts/suite_imports.py torch & torch_side=$$!; \
	    PYTHONDONTWRITEBYTECODE= $(BIN)/python scripts/suite_imports.py services & services=$$!; \
	    $(BIN)/python -c "from tracer import kernels; kernels.warm_up(('float64',), gathers=False)" & f64=$$!; \
	    $(BIN)/python -c "from tracer import kernels; kernels.warm_up(('float32',))" && \
	    wait $$torch_side && wait $$services && wait $$f64
	touch $(STAMP)

demo: setup
	$(BIN)/python -m orchestrator.demo

# The multi-rank tests on one Ray cluster, the single-process ones beside them on several cores (scripts/run_tests.sh).
test: setup chromium
	PY=$(BIN)/python sh scripts/run_tests.sh tests

# The single-process tests only (tests/tracer, tests/workloads, tests/orchestrator): seconds.
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not ray" tests

# Headless Chromium renders report.html in the tests (installed from Debian packages when missing).
chromium:
	sh scripts/ensure_chromium.sh

# Nightly regression run (recipes/sweep/nightly.yaml): `make nightly` (full) or `make nightly nightly=quick`.
nightly ?= full
nightly: setup
	$(BIN)/python -m orchestrator.nightly nightly=$(nightly) $(NIGHTLY_ARGS)

# Tolerance calibration + clean-matrix false positives (every model family and recipe, 8 ranks
# included, judged in full and as stats mode; exits 1 on any) + corruption study + clean checks from a
# checkpoint trained 200 steps (--trained) -> bench/tolerance.json (BENCH_ARGS="--trained 0" skips that)
bench-tolerance: setup
	$(BIN)/python bench/tolerance.py $(BENCH_ARGS)

# Bug catalog: detection, culprit, blame window, loss-curve baseline, scan at the real step, stats mode
# -> bench/bugs.json + bench/bugs.md
# (BENCH_ARGS="--bugs a,b --loss-steps 50" narrows it)
bench-bugs: setup
	$(BIN)/python bench/bugs.py $(BENCH_ARGS)

# The same in bf16: every catalog bug a check runs in bf16 here (bench/bugs.py runs_in), no loss curves
# or scans -> bench/bugs-bf16.json + .md. Exits 1 while bf16 falls short: lr_schedule_local_samples
# (its 2-step trigger is below bf16's noise; a scan finds it) and grad_norm_wrong_group's culprit.
bench-bugs-bf16: setup
	$(BIN)/python bench/bugs.py --precision bf16 --loss-steps 0 --no-scan --out bench/bugs-bf16.json $(BENCH_ARGS)

# ttrace's own cost: tracer overhead, compare vs raw read throughput, demo latency by stage -> bench/perf.json
bench-perf: setup
	$(BIN)/python bench/perf.py $(BENCH_ARGS)

# Fault suite: faults tried / survived (exit 1 or 2 in bounded time) / data lost -> bench/faults.json
# (BENCH_ARGS="--only jobs,trace" narrows it)
bench-faults: setup
	$(BIN)/python bench/faults.py $(BENCH_ARGS)

# The test suite's own cost: wall time, busy CPU-seconds, Ray workers started, peak memory -> bench/suite.json
# (exits 1 on a failed test or a wall time over the goal, 600 s; BENCH_ARGS="--goal-s 900 tests/ray" narrows it;
# BENCH_ARGS=--fresh-clone: `make test` in a fresh clone of HEAD, setup included, as CI runs it)
bench-suite: setup chromium
	$(BIN)/python bench/suite.py $(BENCH_ARGS)

lint: setup
	$(BIN)/ruff check tracer orchestrator workloads tests examples bench hydra_plugins

ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) outputs multirun ttrace_runs mlflow.db mlartifacts nightly bench/bugs_runs bench/errors
