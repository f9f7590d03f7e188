# Set-up and entry points. `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
EXTRAS ?= dev,export

.PHONY: venv test demo bench clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) examples/sparse_train_mlp.py

# Benchmarks compare with PyTorch (CPU build), installed from the `torch` extra.
bench:
	$(MAKE) venv EXTRAS=dev,export,torch
	$(PY) benchmarks/sparse_grad.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/export.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
