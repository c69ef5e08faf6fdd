# One entry point for every check: `make test` runs the Rust and Python suites.
PYTHON ?= python3

.PHONY: install-dev test lint test-rust test-python bench

install-dev:
	$(PYTHON) -m pip install -e ".[dev]"

test: lint test-rust test-python

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PYTHON) -m ruff check python tests benches
	$(PYTHON) -m ruff format --check python tests benches
	$(PYTHON) -m mypy python/ferrox
	lint-imports

# The CPU kernels again under each narrower instruction-set cap, so that a
# machine with AVX-512 also tests the AVX2 and portable code it would not pick.
test-rust:
	cargo test --workspace
	FERROX_CPU_ISA=avx2 cargo test -p ferrox-cpu
	FERROX_CPU_ISA=portable cargo test -p ferrox-cpu

# pytest exits 5 when it collects no test; that is not a failure of the code.
# PYTHONFAULTHANDLER: a crash, even at interpreter exit, prints every thread's
# stack, in each pytest-xdist worker too.
# -n: tests run in PYTEST_WORKERS processes (many wait on servers and
# subprocesses, so two share two cores well); --dist loadfile: a module's
# tests on one of them, in order, as they run alone (tests that look for
# worker processes look among their own process's descendants).
# --durations: the slowest tests, to keep the whole run within its time.
PYTEST_WORKERS ?= 2
test-python:
	$(PYTHON) -m mypy.stubtest ferrox._native
	PYTHONFAULTHANDLER=1 $(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench:
	cargo bench -p ferrox-core
	$(PYTHON) benches/scheduler_step.py
