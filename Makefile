# `make test`: fresh CPU machine -> virtual environment -> the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test install demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tests/constraints.txt
	# the server page's test drives Debian's headless Chromium (root on a fresh Debian machine, as CI's)
	command -v chromedriver >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }
	python3 -m venv $(VENV)
	# --no-compile: pip's bytecode of every installed module took 40 of the 73 s here; the tests compile the ones
	# they import, once (below)
	$(PY) -m pip install -q --no-compile -c tests/constraints.txt torch
	$(PY) -m pip install -q --no-compile -c tests/constraints.txt -e '.[test]'
	touch $@

test: install
	# two workers on the 2-core CI machine, one thread each (tiny tensors: threads only contend); an idle worker
	# takes queued tests from the busy one (worksteal), so the long end-to-end tests do not leave one core idle.
	# PYTHONDONTWRITEBYTECODE emptied: where it is set (this workplace sets it) every test subprocess (CLI, servers,
	# Ray actors, torchrun ranks) compiled what it imported again, torch's and diffusers' modules included
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra -n 2 \
		--dist worksteal --durations=15 tests

# `make demo`: samples/prompts.txt -> samples/out/ with the real model if it is in the local Hugging Face cache and a
# GPU is there, else the tiny random model (its images are noise). No GPU: Triton kernels run in its interpreter.
demo: install
	# PYTHONDONTWRITEBYTECODE emptied as for `make test`: the first run writes the bytecode pip did not
	PYTHONDONTWRITEBYTECODE= $(if $(shell command -v nvidia-smi),,TRITON_INTERPRET=1) HF_HUB_OFFLINE=1 \
		$(VENV)/bin/qwen-image-fast render \
		--model auto --prompts samples/prompts.txt --out samples/out

clean:
	rm -rf $(VENV) build *.egg-info
