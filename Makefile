# `make test`: fresh CPU machine -> virtual environment -> the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tests/constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c tests/constraints.txt torch
	$(PY) -m pip install -q -c tests/constraints.txt -e '.[test]'
	touch $@

test: install
	TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV) build *.egg-info
