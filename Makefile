# `make demo` and `make test` work on a fresh machine with Python and pip only.
# TORCH picks the torch release to install when the installed one (if any) is
# not a tested release: `make test TORCH=2.13.0`. .ci/run runs the suite in a
# clean virtual environment per tested release.
PYTHON ?= python3
TORCH ?= 2.14.1
TESTED_TORCH := 2.13.0 2.14.1
PIP := $(PYTHON) -m pip

.PHONY: install demo test bench

install:
	@$(PYTHON) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v in '$(TESTED_TORCH)'.split() and ('$(origin TORCH)' == 'default' or v == '$(TORCH)') else 1)" 2>/dev/null \
		|| $(PIP) install "torch==$(TORCH)"
	$(PIP) install -q -e ".[dev]"

demo: install
	$(PYTHON) -m overlapc.cli demo

test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider

bench: install
	$(PYTHON) benchmarks/pass_time.py
