# `make test`: fresh CPU machine -> virtual environment -> the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test install demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tests/constraints.txt
	# the server page's test drives Debian's headless Chromium (root on a fresh Debian machine, as CI's)
	command -v chromedriver >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c tests/constraints.txt torch
	$(PY) -m pip install -q -c tests/constraints.txt -e '.[test]'
	touch $@

test: install
	# compiled once here: where PYTHONDONTWRITEBYTECODE is set (this workplace sets it) each test's subprocesses (CLI,
	# servers, Ray actors, torchrun ranks) would compile these sources again (~0.3 s a process)
	$(PY) -m compileall -q qwen_image_fast kernels pipelines tests benchmarks > /dev/null
	# two workers on the 2-core CI machine, one thread each (tiny tensors: threads only contend); an idle worker
	# takes queued tests from the busy one (worksteal), so the long end-to-end tests do not leave one core idle
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra -n 2 --dist worksteal --durations=15 tests

# `make demo`: samples/prompts.txt -> samples/out/ with the real model if it is in the local Hugging Face cache and a
# GPU is there, else the tiny random model (its images are noise). No GPU: Triton kernels run in its interpreter.
demo: install
	$(if $(shell command -v nvidia-smi),,TRITON_INTERPRET=1) HF_HUB_OFFLINE=1 $(VENV)/bin/qwen-image-fast render \
		--model auto --prompts samples/prompts.txt --out samples/out

clean:
	rm -rf $(VENV) build *.egg-info
