# Two entry points on a fresh machine (Python >= 3.10 and pip only):
#   make report   set up .venv and prove the catalogue of identities (python -m verify)
#   make test     set up .venv and run the whole test suite (lint, pytest, MPI under mpiexec)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch (about 780 MB installed; a plain `torch` resolves to a CUDA build of several
# GB). On this machine kind pip finds the 2.13.0 CPU wheel on local disk (pip's find-links).
TORCH ?= torch==2.13.0

.PHONY: report test lint typecheck mpi-test bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,docs,plot,torch,jax]' '$(TORCH)'
	touch $(STAMP)

report: $(STAMP)
	$(PY) -m verify

lint: $(STAMP)
	$(VENV)/bin/ruff check linop verify tests benchmarks notebooks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest

bench: $(STAMP)
	for script in benchmarks/bench_core.py benchmarks/bench_collectives.py benchmarks/bench_halo.py \
			benchmarks/bench_torch.py benchmarks/bench_scale.py; do \
		$(PY) $$script || exit 1; done
	$(PY) benchmarks/bench_layers.py --proof
	for ranks in 2 4; do for script in benchmarks/bench_mpi_halo.py benchmarks/bench_mpi_collectives.py benchmarks/bench_mpi_apply.py \
			benchmarks/bench_mpi_torch.py benchmarks/bench_algorithms.py benchmarks/bench_dad.py; do \
		$(VENV)/bin/mpiexec -n $$ranks $(PY) $$script || exit 1; done; done
	$(VENV)/bin/mpiexec -n 4 $(PY) benchmarks/bench_layers.py

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html
	$(VENV)/bin/jupyter nbconvert --to html --execute --ExecutePreprocessor.timeout=120 \
		--output-dir docs/_build/html/notebooks notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis docs/_build
