# `make demo` and `make test` work on a fresh machine with Python and pip only.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test bench

install:
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
		|| $(PIP) install "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"

demo: install
	$(PYTHON) -m overlapc.cli demo

test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider

bench: install
	$(PYTHON) benchmarks/pass_time.py
