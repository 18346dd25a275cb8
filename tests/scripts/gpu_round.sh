#!/usr/bin/env bash
# One device call (docs/gpu.md, "The third GPU run"): the zoo's MoE models with and without routing replay, its
# hybrids, and the LoRA check rows, each in a process of its own (a GPU process keeps one engine), one after another.
# The zoo's models are built first, once, into a cache every later process reads: their CPU calibration runs
# transformers' reference Gated DeltaNet and Mamba-2 code where fla / mamba-ssm are not installed, which took over
# 110 s a model with three processes sharing the machine's cores (19 s alone on 2 cores).
# Run from the checkout root after ../shared/gpu/README.md's steps; figures under $OUT/m (one JSON per run).
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export COLOGRAD_TEST_MODEL_CACHE=${COLOGRAD_TEST_MODEL_CACHE:-/tmp/zoo-models}
o=$OUT/m; mkdir -p "$o" "$COLOGRAD_TEST_MODEL_CACHE"; T=${T:-150}
MODELS=(Qwen/Qwen3-30B-A3B Qwen/Qwen3-Next-80B-A3B-Instruct Qwen/Qwen3.5-4B nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
        moonshotai/Kimi-Linear-48B-A3B-Instruct)
python3 -c "import sys; sys.path.insert(0, 'tests'); import zoo; [zoo.stopping_model(n) for n in sys.argv[1:]]" \
  "${MODELS[@]}" > /tmp/build.log 2>&1 || tail -5 /tmp/build.log
m() { n=$1; shift; timeout "$T" python3 tests/scripts/gpu_models.py "$o/$n.json" "$@" --stacks-after $((T - 20)) > /tmp/$n.log 2>&1
      echo "$n rc=$? $(grep ^ROW /tmp/$n.log | cut -c1-900)"; }
r() { timeout "$T" python3 -m colograd.check --row "$2" --json "$o/$1.json" > /tmp/$1.log 2>&1; echo "$1 rc=$? $(cut -c1-300 "$o/$1.json")"; }
m q3moe-replay Qwen/Qwen3-30B-A3B --bf16 --replay
m q3moe-off Qwen/Qwen3-30B-A3B --bf16
m qnext-replay Qwen/Qwen3-Next-80B-A3B-Instruct --bf16 --replay
m q35-4b Qwen/Qwen3.5-4B --bf16
m nemo3 nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --bf16
m kimi-replay moonshotai/Kimi-Linear-48B-A3B-Instruct --bf16 --replay
r lora-sleep2 "LoRA sleep level 2"
