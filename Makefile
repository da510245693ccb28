# Two commands for a new user: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on a fresh machine and installs meshkit into it (editable).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEVICES ?= 8
DEMO_DIR ?= runs/lm_cpu
# Transparent huge pages for glibc's malloc (where the kernel's THP mode is `madvise`, most
# distributions' default): XLA:CPU maps a step's temporaries afresh at every step, and faulting
# them in 4 KiB at a time was about a third of a CPU run's CPU time on 2 cores. With it the CPU
# demo's steps take 0.70x the time, its whole run 0.78x, with the same losses to the bit
# (scripts/bench/bench_hugepages.py). Every command below runs with it, as do their child processes;
# a GLIBC_TUNABLES of your own is kept, and one that sets glibc.malloc.hugetlb wins.
ifeq ($(findstring glibc.malloc.hugetlb,$(GLIBC_TUNABLES)),)
export GLIBC_TUNABLES := $(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1
endif

.PHONY: demo test test-slow test-full test-newest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The demo needs meshkit only; the tests also need pytest and libtpu (TPU compiles from a CPU).
# pip byte-compiles what it installs one file at a time; compileall on every core does the same
# work on 2 cores in less time (the test extras' install: 158 s -> 138 s). A file it cannot compile
# (torch ships some in newer Python syntax) is skipped as pip skips it.
PYC := $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e .
	$(PYC)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e ".[test]"
	$(PYC)
	touch $@

# Trains the CPU LM on 8 simulated devices (fsdp x tensor), saves a checkpoint, prints a sample.
# A second `make demo` resumes from that checkpoint and has nothing left to do; `make clean` resets.
demo: $(VENV)/.installed
	XLA_FLAGS=--xla_force_host_platform_device_count=$(DEVICES) \
	  $(BIN)/python -m toolkit.train --config=experiments/lm.py:cpu --workdir=$(DEMO_DIR)

# The default suite: everything but tests marked slow, in WORKERS processes (pytest-xdist; a
# test module stays in one process, so its fixtures are computed once); 9.5-10.4 minutes on the
# 2 cores of a 2.1 GHz Intel Xeon (fresh clones in CI), at
# its 10-minute budget (docs/testing.md). pytest lists the slowest 15 at the end, then the wall
# time.
WORKERS ?= 2
test: $(VENV)/.installed-test
	@start=$$(date +%s); status=0; \
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope -m "not slow and not full" --durations=15 \
	  $(PYTEST_ARGS) || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall"; exit $$status

# The presubmit tier's slow tests (tests/tiers.py): each documented result on seed 0, one TPU
# compile per code path, the process drills. .ci/run runs `make test` and then this. Two
# processes again, a module per process but for the documented results and commands, whose long
# parts spread over both (tests/conftest.py).
test-slow: $(VENV)/.installed-test
	@start=$$(date +%s); status=0; \
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope -m "slow and not full" --durations=15 \
	  $(PYTEST_ARGS) || status=$$?; \
	echo "make test-slow: $$(( $$(date +%s) - start )) s wall"; exit $$status

# The full tier: every test, the presubmit tier's and the full tier's (every seed of every
# documented result, every documented command and TPU compile). Run it before an issue whose
# change touches a documented result's or command's code path ends (docs/testing.md).
# It ends with its wall time against FULL_BUDGET_S, naming its five slowest tests when over.
FULL_BUDGET_S ?= 4800
test-full: $(VENV)/.installed-test
	@start=$$(date +%s); log=$$(mktemp); \
	{ $(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --durations=15 \
	  $(PYTEST_ARGS) || echo $$? > $$log.rc; } 2>&1 | tee $$log; \
	status=$$(cat $$log.rc 2>/dev/null || echo 0); wall=$$(( $$(date +%s) - start )); \
	echo "make test-full: $$wall s wall"; \
	$(BIN)/python .ci/budget.py "full (make test-full)" $$wall $(FULL_BUDGET_S) $$log; \
	rm -f $$log $$log.rc; exit $$status

# The newest-deps job: Python 3.12 with the newest release of every dependency, the tests
# marked smoke (train, resume, sharded == unsharded, Grain's batches, HF parity, a TPU compile,
# one served request). scripts/dev/ci_newest.sh creates its own .venv-newest; .ci/run runs it beside
# the two halves at a low priority.
test-newest:
	bash scripts/dev/ci_newest.sh

bench: $(VENV)/.installed
	$(BIN)/python scripts/bench/bench_step.py

clean:
	rm -rf runs
