# The README's two quick-start commands are `make train` and `make test`.
# Both create .venv when missing and install every dependency into it.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TRAIN_ARGS ?=

.PHONY: setup train test test-ut test-st bench clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[test]'
	# test-only: torchvision's Python code for the HF video-processor oracle, run in a child process
	# (--no-deps, outside the venv's import path: its C extension cannot load beside this torch)
	$(VPY) -m pip install --quiet --no-deps --target $(VENV)/hf_oracle torchvision==0.28.0
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

train: setup
	$(VPY) -m hyper_parallel.train --module glm_image_moe --config glm_image_moe_debug $(TRAIN_ARGS)

# one intra-op thread per test process (tiny models; the multi-process tests start several on 2 cores)
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VPY) -m pytest -q tests

test-ut: setup
	$(VPY) -m pytest -q tests/torch/ut

test-st: setup
	$(VPY) -m pytest -q tests/torch/st

bench: setup
	$(VPY) benchmarks/model_step.py
	$(VPY) benchmarks/lora_step.py
	$(VPY) benchmarks/data_pipeline.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
