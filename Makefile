# Two entry points on a fresh machine (Python >= 3.10 and pip only):
#   make report   set up .venv with the core alone (numpy, scipy, sympy, hypothesis,
#                 array-api-compat; about 290 MB) and prove the catalogue (python -m verify)
#   make test     set up .venv with every extra and run the whole test suite (lint, pytest, MPI)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: Python compiles what it imports on first use and keeps the bytecode; compiling
# every installed file (all of sympy, torch) would double the install time. "Keeps" needs bytecode
# writing on: with PYTHONDONTWRITEBYTECODE set (common in containers, and set on this project's CI
# machine) each of the suite's processes (MPI ranks, torch.distributed and JAX launches, notebook
# kernels, CLI runs) would compile torch, JAX, scipy and sympy from source again, about 4 s of CPU
# per process; so the targets below run without it.
unexport PYTHONDONTWRITEBYTECODE
# pip prints what it collects and installs (no progress bars: one line per step, so a long
# install shows that it is moving); each phase below starts with a line of its own.
PIP := $(PY) -m pip install --progress-bar off --disable-pip-version-check --no-compile
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
# torch for `make test`. A plain `torch` from PyPI is a CUDA build of several GB on Linux; the CPU
# build (about 750 MB installed) comes from PyTorch's CPU index:
#   make test TORCH_INDEX=--extra-index-url=https://download.pytorch.org/whl/cpu
# (README: "Install"). On this project's CI machine pip finds the 2.13.0 CPU wheel on local disk.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: report test lint typecheck mpi-test bench docs clean

$(CORE_STAMP): pyproject.toml
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing linop with its core dependencies into $(VENV) (about 290 MB)"
	$(PIP) -e .
	touch $(CORE_STAMP)

# `make test` installs everything in one pip call (the core and the extras: one resolution, one
# build of the editable project), then writes the bytecode of what the suite's processes import
# (pip's default, which --no-compile above leaves to first use): otherwise the suite's first
# processes (the MPI ranks, torch.distributed and JAX launches, all started together) each compile
# torch, JAX and sympy from source at the same time, about 5 s of CPU each. Two processes import
# the two halves side by side (pip runs on one core); a failed import fails the install. The lists
# name what the suite's processes import beyond the packages' tops (torch's compiler, which an
# optimizer's construction imports; the notebook kernels' debugger; the docs' cache): a clean CI run
# left about 2,500 files compiled by the suite itself without them.
WARM_FRAMEWORKS := torch.distributed, torch.multiprocessing, jax.numpy, jax.experimental.shard_map, \
	torch._dynamo, torch._inductor.compile_fx, torch.distributed.run, torch.distributed.tensor, \
	torch.distributed.fsdp, torch.optim, equinox
WARM_TOOLS := sympy, scipy.sparse, matplotlib.pyplot, mpi4py.MPI, hypothesis, pytest, IPython, \
	ipykernel.kernelapp, nbclient, nbformat, sphinx.application, myst_nb, numpydoc, furo, mypy.api, linop, verify, \
	scipy.stats, scipy.optimize, scipy.signal, scipy.interpolate, scipy.integrate, scipy.ndimage, \
	array_api_strict, setuptools, xdist, sphinx.ext.autodoc
# What the packages above import in turn (their own dependencies, which may change): warmed where
# found, never failing the install.
WARM_DEPENDENCIES := networkx jaxtyping debugpy sqlalchemy.orm jupyter_cache execnet requests yaml
$(STAMP): pyproject.toml
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing linop with every extra into $(VENV) (about 1.9 GB: several minutes)"
	$(PIP) $(TORCH_INDEX) -e '.[dev,docs,plot,torch,jax,equinox]' '$(TORCH)'
	touch $(CORE_STAMP)
	@echo "==> compiling what the test processes import (torch, JAX, sympy, the tools)"
	$(PY) -c "import $(WARM_FRAMEWORKS)" & frameworks=$$!; $(PY) -c "import $(WARM_TOOLS)" && wait $$frameworks
	$(PY) -c "import importlib, importlib.util as u; [importlib.import_module(m) for m in '$(WARM_DEPENDENCIES)'.split() if u.find_spec(m.split('.')[0])]"
	touch $(STAMP)

report: $(CORE_STAMP)
	@echo "==> proving the catalogue (python -m verify)"
	$(PY) -m verify

# The type check: mypy on linop, verify and the README's API tour (what users type), in one run
# (tests/test_readme.py, which the test run itself skips unless LINOP_TYPECHECK=1).
TYPECHECK := LINOP_TYPECHECK=1 $(PY) -m pytest -q -o addopts= -p no:cacheprovider \
	tests/test_readme.py::test_the_package_and_the_readme_tour_type_check

lint: $(STAMP)
	@echo "==> ruff: lint and format"
	$(VENV)/bin/ruff check linop verify tests benchmarks notebooks examples
	$(VENV)/bin/ruff format --check linop verify tests benchmarks examples
	@echo "==> mypy: linop, verify and the README tour (a few minutes on a loaded machine)"
	$(TYPECHECK)

typecheck: $(STAMP)
	$(TYPECHECK)

# -n auto: one pytest-xdist worker per core; --dist loadgroup keeps the tests that share work on
# one worker (tests/conftest.py: GROUPS). The type check runs before, in `make lint`; the MPI
# launch prints a line as each size's pass starts and ends. --max-worker-restart=0: a worker that dies (the OOM killer, a crash) ends the run as a
# failure; a replaced worker can wait forever for the tests of the group its predecessor held.
# --no-loadscope-reorder: the workers take the tests in the suite's order (the longest launches
# first: tests/conftest.py, LAUNCHES), not the groups with the most tests first.
test: lint
	@echo "==> the test suite (pytest, one worker per core; MPI and torch.distributed launches included)"
	$(PY) -m pytest -n auto --dist loadgroup --no-loadscope-reorder --max-worker-restart=0

bench: $(STAMP)
	for script in benchmarks/bench_core.py benchmarks/bench_collectives.py benchmarks/bench_halo.py \
			benchmarks/bench_torch.py benchmarks/bench_scale.py; do \
		$(PY) $$script || exit 1; done
	$(PY) benchmarks/bench_layers.py --proof
	for ranks in 2 4; do for script in benchmarks/bench_mpi_halo.py benchmarks/bench_mpi_collectives.py benchmarks/bench_mpi_apply.py \
			benchmarks/bench_mpi_torch.py benchmarks/bench_algorithms.py benchmarks/bench_dad.py; do \
		$(VENV)/bin/mpiexec -n $$ranks $(PY) $$script || exit 1; done; done
	$(VENV)/bin/mpiexec -n 4 $(PY) benchmarks/bench_layers.py

# The notebooks are part of the docs (myst-nb executes them during the build); math renders
# from the MathJax copy in the build (no network).
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis docs/_build
