# `make demo` and `make test` work on a fresh machine with Python and pip only.
# TORCH picks the torch release to install when the installed one (if any) is
# not a tested release: `make test TORCH=2.13.0`. .ci/run runs the suite in a
# clean virtual environment per tested release.
PYTHON ?= python3
TORCH ?= 2.14.1
TESTED_TORCH := 2.13.0 2.14.1
PIP := $(PYTHON) -m pip
# WITH_TORCHTITAN=1: also install torchtitan 0.3.0's graph_trainer and what its
# modules import, for tests/test_torchtitan.py (skipped, with the reason, without).
# torchtitan's own requirements would replace torch, so it goes in without them.
WITH_TORCHTITAN ?= 0
TORCHTITAN_NO_DEPS := torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0 tensorboard==2.21.0 \
	protobuf==7.36.2 absl-py==2.5.1 tokenizers==0.23.3
TORCHTITAN_DEPS := numpy==2.4.6 tyro==1.0.17 "datasets>=3.6,<4.8"

.PHONY: install install-torch install-torchtitan demo test bench

install: install-torch
	$(PIP) install -q -e ".[dev]"
	@if [ "$(WITH_TORCHTITAN)" = 1 ]; then $(MAKE) --no-print-directory install-torchtitan PYTHON=$(PYTHON); fi

install-torch:
	@$(PYTHON) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v in '$(TESTED_TORCH)'.split() and ('$(origin TORCH)' == 'file' or v == '$(TORCH)') else 1)" 2>/dev/null \
		|| $(PIP) install "torch==$(TORCH)"

install-torchtitan:
	$(PIP) install -q --no-deps $(TORCHTITAN_NO_DEPS)
	$(PIP) install -q $(TORCHTITAN_DEPS)

demo: install
	$(PYTHON) -m overlapc.cli demo

# TEST_WORKERS: pytest-xdist processes (2 fits CI's 2 cores; 1 runs the suite in-process).
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS))

# make bench: reruns the cheap, CPU-only benchmarks whose results are committed,
# each writing its JSON (with benchmarks/provenance.py's record: commit, torch,
# machine, date, command) into benchmarks/results/. About 25 minutes on 2 idle
# cores: pass_time ~2 min, rankcheck_cost ~2 min, byte_modes ~1 min, random_dags ~4 min, joint_graph ~2 min (only with
# torchtitan installed: make bench WITH_TORCHTITAN=1), projection ~13 min (32
# layers captured on the meta device; simulated, so load changes only its wall
# time). Timings taken on a loaded machine are loaded: say so where they are quoted.
# Not here (docs/performance.md gives their commands): step_time.py and tp_moe.py
# (root for the shaped link, ~25 min each), compile_cost.py (~40 min), gpu_check.py (a GPU).
RESULTS := benchmarks/results
bench: install
	$(PYTHON) benchmarks/pass_time.py --repeat 5 --sizes 1000 10000 27770 100000 --json $(RESULTS)/pass_time.json
	$(PYTHON) benchmarks/rankcheck_cost.py --json $(RESULTS)/rankcheck_cost.json
	$(PYTHON) benchmarks/byte_modes.py --json $(RESULTS)/byte_modes.json
	$(PYTHON) benchmarks/random_dags.py --json $(RESULTS)/random_dags.json
	@if $(PYTHON) -c "import torchtitan" 2>/dev/null; then \
		$(PYTHON) benchmarks/joint_graph.py --options '{"bucket": "module"}' --json $(RESULTS)/joint_graph.json \
		&& $(PYTHON) benchmarks/joint_graph.py --mesh hsdp --json $(RESULTS)/joint_graph_hsdp.json; \
	else echo "bench: joint_graph skipped: torchtitan is not installed (make bench WITH_TORCHTITAN=1)"; fi
	$(PYTHON) benchmarks/projection.py --hsdp 8 --json $(RESULTS)/projection.json > $(RESULTS)/projection.log 2>&1; \
		status=$$?; tail -n 12 $(RESULTS)/projection.log; exit $$status
