# Two entry points that work on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ember-installed
# The CPU build of torch; GPU users install their own torch first and we keep it.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/ember demo

bench: $(STAMP)
	for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
