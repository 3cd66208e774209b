# The README's two commands: `make demo` and `make test`. Each makes its own virtualenv.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test chaos bench venv system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

system-deps:
	scripts/install-system-deps

demo: $(STAMP)
	$(VENV)/bin/sglang-supervisor demo

test: $(STAMP) system-deps
	$(PY) -m pytest -q -ra

chaos: $(STAMP) system-deps
	CHAOS_TRIALS=$${CHAOS_TRIALS:-20} $(PY) -m pytest -q -ra -m chaos tests/chaos

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
