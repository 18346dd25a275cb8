"""The benchmarks' and the phase timers' own arithmetic (their figures come from running them, not from tests)."""

import json
import os
from collections import defaultdict

import pytest
import torch

from colograd.bench import memory
from colograd.bench.memory import heap_in_use_mib, slope_per_100_steps
from colograd.runs.timing import PhaseTimes, format_summary, throughput


def test_slope_of_a_steady_leak_and_of_a_flat_line():
    assert slope_per_100_steps([1000 + 0.5 * i for i in range(50)]) == pytest.approx(50.0)
    # x = 0..5, y alternating 0/1: cov = 1.5, var = 17.5 (worked by hand)
    assert slope_per_100_steps([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]) == pytest.approx(100 * 1.5 / 17.5)
    assert slope_per_100_steps([7.0] * 10) == 0.0


def test_the_heap_count_sees_an_allocation_and_its_release():
    """What the memory soak records beside the RSS: memory allocated and not freed (a freed block counts no more, where
    RSS would keep a free heap's pages)."""
    if heap_in_use_mib() is None:
        pytest.skip("the C library has no mallinfo2 (glibc 2.33+)")
    before = heap_in_use_mib()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB
    held = heap_in_use_mib()
    del block
    assert held - before == pytest.approx(64, abs=2)
    assert heap_in_use_mib() - before == pytest.approx(0, abs=2)


def test_the_memory_soak_refuses_a_model_it_has_no_workload_for():
    with pytest.raises(ValueError, match="memory: --model is one of tiny, qwen3.5, not 'smollm2'"):
        memory.run(steps=1, model="smollm2")


def test_throughput_counts_every_process_and_skips_phases_without_time():
    rates = throughput({"generated": 300.0, "trained": 900.0}, {"generate": 2.0, "train": 0.0}, processes=2)
    assert rates == {"throughput/generate_tokens_per_s": 300.0}  # 300 per process × 2 over 2 s; train not timed


def test_phase_times_feed_the_window_and_the_run_totals():
    times, window = PhaseTimes(), defaultdict(list)
    with times.timed("generate", window):
        pass
    times.add("generate", 0.5, window)
    times.count("generated", 40, window)
    assert len(window["time/generate"]) == 2 and times.seconds["generate"] >= 0.5
    assert window["tokens/generated"] == [40] and times.tokens["generated"] == 40
    summary = format_summary(4, {"generate": 1.0, "train": 3.0}, {"throughput/train_tokens_per_s": 1234.0})
    assert "generate        1.00 s   25.0%" in summary and "train tokens/s (all processes): 1,234" in summary


def test_training_flops_count_every_matrix_product_by_hand():
    from types import SimpleNamespace

    from colograd.bench.step import training_flops

    # One layer, hidden 2 (2 heads of 1, one KV head), MLP 3, vocabulary 5: q, o 2×2 each; k, v 2×1 each;
    # gate, up, down 2×3 each: 8 + 4 + 18 = 30 weights per layer; the output layer 2×5.
    config = SimpleNamespace(hidden_size=2, intermediate_size=3, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=5)  # fmt: skip
    assert training_flops(config, trained_tokens=7, completion_tokens=3) == 6 * 30 * 7 + 8 * 10 * 3


def _report_fields(model: str, **overrides) -> dict:
    """A step result as `run` returns it, with made-up figures, for the report's own formatting."""
    from colograd.bench.shapes import workload

    phases = {"generate": 10.0, "train": 20.0}
    return {
        "workload": {**workload(model), "model": model, "dtype": "fp32"},
        "colograd_steps_per_s": 0.03, "trl_steps_per_s": 0.015, "colograd_tokens_per_s": 20.0,
        "trl_tokens_per_s": 10.0, "speedup_vs_trl": 2.0, "trl_mode": "use_vllm=False (transformers generate)",
        "trl_version": "1.16.0", "vllm_version": "0.32.0", "trl_supported_vllm": ["0.22.0", "0.31.0"],
        "trl_side_note": None,
        "colograd_phases_s": phases, "trl_phases_s": phases,
        "colograd_peak_rss_mib": 5120.0, "trl_peak_rss_mib": 4096.0,
        "colograd_peak_gpu_mib": None, "colograd_peak_gpu_reserved_mib": None, "colograd_peak_gpu_mib_by_phase": None,
        "trl_peak_gpu_mib": None, "trl_peak_gpu_reserved_mib": None, "trl_peak_gpu_mib_by_phase": None,
        **overrides,
    }  # fmt: skip


def test_step_report_of_the_pretrained_model_shows_memory_and_leaves_out_the_engine_comparisons():
    from colograd.bench.step import report

    result = _report_fields(
        "smollm2", machine_matmul_gflops=150.0, colograd_train_gflops=100.0, trl_train_gflops=50.0,
        colograd_train_gflops_executed=60.0, trained_tokens_per_step=2000.0, forwarded_tokens_per_step=750.0,
    )  # fmt: skip
    text = report(result)
    assert "4 prompts × 8 completions of ≤32 tokens" in text and "in 4 micro-step(s)" in text
    assert "GFLOP/s of useful work: colograd 100, TRL 50; the machine's matrix product 150" in text
    assert "colograd forwards 750 of the step's 2,000 tokens (prompts shared), executing 60 GFLOP/s" in text
    assert "peak resident memory per process: colograd 5,120 MiB, TRL 4,096 MiB" in text
    assert "speedup_vs_trl 2.00" in text and "bare vllm" not in text
    assert "GPU" not in text  # no GPU: the fields are None, and no line shows them
    assert "TRL 1.16.0, vLLM 0.32.0 (TRL supports vLLM 0.22.0 to 0.31.0)" in text and "comparable" not in text


def test_step_figures_carry_the_worst_sampling_gap_of_the_timed_steps_and_the_report_shows_it():
    """The gate's figure (engine against trainer, worst token) of colograd's timed steps, warm-up left out: a GPU
    proof's step row shows it beside the speed, so a fast step that sampled from other weights is seen."""
    from colograd.bench.step import GAP, StepClock, _timed_steps, report

    clock = StepClock()
    clock.ends = [0.0, 9.0, 19.0, 28.0]  # three steps of 9, 10 and 9 s
    steps = [{"loss": 0.1, "completions/mean_length": 8.0, GAP: gap} for gap in (0.9, 0.02, 0.05)]
    figures = _timed_steps(steps, clock, completions_per_step=4, w=1)
    assert figures["sampling_gap_max"] == 0.05 and figures["steps_per_s"] == 2 / 19
    unlogged = [{k: v for k, v in h.items() if k != GAP} for h in steps]
    assert "sampling_gap_max" not in _timed_steps(unlogged, clock, 4, 1)
    text = report(_report_fields("qwen3.5", colograd_sampling_gap_max=0.05))
    assert "tokens/s  (sampling gap, worst token: 0.05)" in text
    assert "sampling gap" not in report(_report_fields("qwen3.5"))


def test_step_report_on_a_gpu_shows_memory_per_phase_and_generation_against_bare_vllm():
    from colograd.bench.step import report

    mib = {"startup": 30000.0, "generate": 31000.0, "train": 52500.0, "optimizer": 40000.0}
    result = _report_fields(
        "qwen2.5-1.5b", colograd_peak_gpu_mib=52500.0, colograd_peak_gpu_reserved_mib=60000.0,
        colograd_peak_gpu_mib_by_phase=mib, trl_peak_gpu_mib=70000.0, trl_peak_gpu_reserved_mib=72000.0,
        trl_peak_gpu_mib_by_phase={"train": 70000.0}, colograd_generation_tokens_per_s=9000.0,
        bare_vllm_tokens_per_s=10000.0, bare_vllm_logprobs0_tokens_per_s=4500.0, generation_vs_bare_vllm=0.9,
        colograd_generation_between_logs_tokens_per_s=9900.0, generation_between_logs_vs_bare_vllm=0.99,
        packed_tokens_per_s=3.0, padded_tokens_per_s=1.0, packed_vs_padded=3.0, padding_fraction=0.5,
        decode_sequences=128, decode_ms_per_step=3.43, decode_floor_ms=1.14, decode_vs_floor=3.0,
        memory_bandwidth_gb_s=3000.0,
    )  # fmt: skip
    text = report(result)
    assert "decode step, 128 sequences (bare, EOS ignored): 3.43 ms; memory-read floor 1.14 ms" in text
    assert "at 3000 GB/s measured), decode_vs_floor 3.00" in text
    assert "16 prompts × 8 completions of ≤256 tokens per step in 4 micro-step(s)" in text
    assert "peak GPU memory allocated (reserved): colograd 52,500 (60,000) MiB, TRL 70,000 (72,000) MiB" in text
    assert "train      colograd     52,500 MiB   TRL     70,000 MiB" in text
    assert "sync       colograd          - MiB   TRL          - MiB" in text  # not measured is not zero
    assert "bare vllm.LLM.generate 10000 tokens/s with logprobs=None (4500 with logprobs=0)" in text
    assert "generation_vs_bare_vllm 0.90 on a step that logs" in text
    assert "on a step between logs 9900 tokens/s, generation_between_logs_vs_bare_vllm 0.99" in text


def test_trl_figure_is_not_comparable_where_trl_does_not_support_the_installed_vllm():
    from colograd.bench.step import report, trl_side_note

    colocate, generate = "use_vllm=True, vllm_mode=colocate", "use_vllm=False (transformers generate)"
    supported = ("0.22.0", "0.31.0")
    assert trl_side_note(colocate, "1.16.0", "0.31.0", supported) is None  # the bounds are supported
    assert trl_side_note(colocate, "1.16.0", "0.22.0", supported) is None
    assert trl_side_note(colocate, "1.16.0", "0.31.0+cu129", supported) is None  # a local build of a supported one
    note = trl_side_note(colocate, "1.16.0", "0.32.0", supported)
    assert note.startswith("not comparable: TRL 1.16.0 supports vLLM 0.22.0 to 0.31.0") and "vLLM 0.32.0" in note
    assert trl_side_note(colocate, "1.16.0", "0.21.9", supported).startswith("not comparable")
    assert trl_side_note(generate, "1.16.0", "0.32.0", supported) is None  # TRL's side runs no vLLM
    assert "could not be read" in trl_side_note(colocate, "1.16.0", "0.32.0", None)
    text = report(_report_fields(
        "smollm2", trl_mode=colocate, trl_side_note=note, machine_matmul_gflops=150.0, colograd_train_gflops=100.0,
        trl_train_gflops=50.0, colograd_train_gflops_executed=60.0, trained_tokens_per_step=2000.0,
        forwarded_tokens_per_step=750.0,
    ))  # fmt: skip
    assert f"TRL's figure is {note}" in text


def test_trl_supported_vllm_is_the_range_trls_own_check_accepts(monkeypatch):
    import warnings

    from packaging.version import Version
    from trl import import_utils

    from colograd.bench.step import trl_supported_vllm

    low, high = trl_supported_vllm()

    def warns(version: str) -> bool:  # TRL's check, given a fake installed vLLM
        monkeypatch.setattr(import_utils, "_is_package_available", lambda *a, **k: (True, version))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import_utils.is_vllm_available()
        return any("supports vLLM" in str(w.message) for w in caught)

    assert not warns(low) and not warns(high) and not warns(f"{high}+cu129")  # a local build counts as its release
    above, below = Version(high), Version(low)
    assert warns(f"{above.major}.{above.minor + 1}.0")
    assert below.minor == 0 or warns(f"{below.major}.{below.minor - 1}.0")


def test_qwen_shapes_have_the_real_models_layers_and_parameters():
    from transformers import Qwen2ForCausalLM

    from colograd.bench.shapes import build_config, non_embedding_parameters

    # Qwen2.5's report: 0.36B and 1.31B non-embedding parameters; "small" is the CPU model of ~9.5M.
    expected = {"qwen2.5-0.5b": 0.36e9, "qwen2.5-1.5b": 1.31e9, "small": 9.45e6}
    layers = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864), "qwen2.5-1.5b": (1536, 28, 12, 2, 8960)}
    for shape, count in expected.items():
        config = build_config(shape)
        with torch.device("meta"):  # sizes only: no memory, no initialisation
            model = Qwen2ForCausalLM(config)
        assert non_embedding_parameters(model) == pytest.approx(count, rel=0.02), shape
        assert config.tie_word_embeddings and config.vocab_size == 64
        if shape in layers:
            c = config
            sizes = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                     c.intermediate_size)  # fmt: skip
            assert sizes == layers[shape]
    assert build_config("tiny", context=2000).max_position_embeddings == 2000  # room for a long workload


def test_step_flags_give_the_gpu_workload():
    from colograd.bench.__main__ import SHAPES, build_parser, step_workload
    from colograd.bench.shapes import SHAPES as BUILT
    from colograd.bench.shapes import workload

    assert SHAPES == list(BUILT)
    command = "step --shape qwen2.5-1.5b --prompts 16 --generations 8 --completion-tokens 256 --accumulation 4"
    args = build_parser().parse_args([*command.split(), "--dtype", "bf16", "--steps", "5", "--prompt-tokens", "64"])
    model, settings = step_workload(args)
    w = workload(model, **settings)
    assert model == "qwen2.5-1.5b" and args.dtype == "bf16"
    assert (w["prompts"], w["num_generations"], w["max_completion_length"]) == (16, 8, 256)
    assert (w["gradient_accumulation_steps"], w["steps"], w["prompt_tokens"]) == (4, 5, 64)
    # Flags not given keep the model's workload: the CPU default for the small model.
    model, settings = step_workload(build_parser().parse_args(["step", "--warmup", "0"]))
    assert model == "small" and workload(model, **settings)["prompts"] == 2 and settings == {"warmup": 0}
    with pytest.raises(SystemExit):
        step_workload(build_parser().parse_args(["step", "--shape", "tiny", "--model", "smollm2"]))
    # The hybrid is sized for a CPU: the CPU's workload, not the GPU's of the Qwen2.5 shapes.
    model, settings = step_workload(build_parser().parse_args(["step", "--model", "qwen3.5"]))
    assert model == "qwen3.5" and workload(model, **settings) == workload("small")
    model, settings = step_workload(build_parser().parse_args(["step", "--model", "qwen3.5-4b-layers"]))
    assert model == "qwen3.5-4b-layers" and workload(model, **settings) == workload("small")


def test_the_4b_layers_are_qwen3_5_4bs_layers():
    """`qwen3.5-4b-layers` is one period of Qwen3.5-4B's pattern at its published widths: each of its 4 layers holds
    as many parameters as one of the real model's 32 (built on the meta device: no memory)."""
    import zoo
    from transformers import AutoConfig, AutoModelForCausalLM

    from colograd.bench.shapes import HYBRID_4B_SHAPE, build_hybrid_model

    published = zoo.HYBRIDS["Qwen/Qwen3.5-4B"]
    differ = {k: (v, published[k]) for k, v in HYBRID_4B_SHAPE.items() if published.get(k) != v}
    assert set(differ) == {"num_hidden_layers", "max_position_embeddings"}, differ
    with torch.device("meta"):
        ours = build_hybrid_model(49, 103, "qwen3.5-4b-layers")
        real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**published, "vocab_size": 49}))
    layers = [sum(p.numel() for p in m.model.layers.parameters()) / len(m.model.layers) for m in (ours, real)]
    assert ours.config.layer_types == real.config.layer_types[:4]
    assert layers[0] == layers[1] and round(sum(p.numel() for p in ours.parameters()) / 1e6) == 446


def test_vlm_flags_give_a_llava_workload_of_fixed_length_completions():
    from colograd.bench.__main__ import LLAVA, build_parser, vlm_workload
    from colograd.bench.shapes import LLAVA as BUILT
    from colograd.bench.shapes import workload
    from colograd.errors import ConfigError

    assert LLAVA == BUILT
    model, settings = vlm_workload(build_parser().parse_args(["vlm"]))
    w = workload(model, **settings)
    assert model == "llava-small" and settings == {}
    assert (w["prompts"], w["num_generations"], w["max_completion_length"], w["fixed_length"]) == (2, 8, 256, True)
    assert w["steps"] >= 3 and w["warmup"] >= 1  # medians of several steps after a warm-up
    args = build_parser().parse_args("vlm --shape tiny --completion-tokens 128 --steps 3 --generations 4".split())
    model, settings = vlm_workload(args)
    w = workload(model, **settings)
    assert model == "llava-tiny" and (w["max_completion_length"], w["steps"], w["num_generations"]) == (128, 3, 4)
    assert not workload("small")["fixed_length"]  # the text step benchmark's completions end where they end
    with pytest.raises(SystemExit):
        vlm_workload(build_parser().parse_args(["vlm", "--model", "smollm2"]))
    with pytest.raises(ConfigError, match="--prompt-tokens"):
        workload("llava-small", prompt_tokens=64)


def test_vlm_sides_train_the_same_llava_and_generate_exactly_the_completion_length(tmp_path, monkeypatch):
    import trl
    from transformers import LlavaForConditionalGeneration

    from colograd.bench import step
    from colograd.bench.shapes import SHAPES, build_task, workload

    seen = {}
    stand_in = _stand_in(seen)
    monkeypatch.setattr(step, "GRPOTrainer", stand_in)
    monkeypatch.setattr(trl, "GRPOTrainer", stand_in)
    w = {**workload("llava-small", steps=1, warmup=0), "model": "llava-small", "dtype": "bf16"}
    with pytest.raises(_Stop):
        step.run_colograd(str(tmp_path), w)
    ours = seen.copy()
    assert isinstance(ours["model"], LlavaForConditionalGeneration)
    text = ours["model"].config.text_config
    assert (text.hidden_size, text.num_hidden_layers) == (SHAPES["small"]["hidden_size"], 6)
    assert ours["args"].generation_kwargs == {"min_tokens": 256} and ours["args"].max_completion_length == 256
    assert len(ours["train_dataset"][0]["prompt"]) == 1 and ours["train_dataset"][0]["image"] is not None
    with pytest.raises(_Stop):
        step.run_trl(str(tmp_path), w, mode="use_vllm=False (transformers generate)")
    loaded = LlavaForConditionalGeneration.from_pretrained(seen["model"])  # TRL gets the same weights, saved
    for (name, a), (_, b) in zip(loaded.state_dict().items(), build_task("llava-small", w)[0].state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    assert seen["args"].generation_kwargs == {"min_new_tokens": 256} and not seen["args"].use_vllm
    assert seen["args"].max_completion_length == 256 and seen["args"].per_device_train_batch_size == 16
    with pytest.raises(_Stop):  # TRL's colocated vLLM (a GPU's) takes vLLM's name
        step.run_trl(str(tmp_path / "gpu"), w, mode="use_vllm=True, vllm_mode=colocate")
    assert seen["args"].generation_kwargs == {"min_tokens": 256}
    # The text benchmark's sides stop where the model stops.
    w = {**workload("tiny", steps=1, warmup=0), "model": "tiny", "dtype": "bf16"}
    with pytest.raises(_Stop):
        step.run_colograd(str(tmp_path / "text"), w)
    assert seen["args"].generation_kwargs is None


def test_vlm_report_shows_medians_ratio_and_phases():
    from colograd.bench.shapes import workload
    from colograd.bench.vlm import report

    phases = {"generate": 2.0, "train": 1.5}
    text = report({
        "workload": {**workload("llava-small"), "model": "llava-small", "dtype": "bf16"},
        "trl_mode": "use_vllm=False (transformers generate)", "omp_wait_policy": "PASSIVE",
        "load_average_1min": {"colograd": 2.5, "trl": 3.3},
        "colograd_step_s_median": 4.0, "trl_step_s_median": 8.6, "speedup_vs_trl": 2.15,
        "colograd_completion_tokens_per_step": 4096.0, "trl_completion_tokens_per_step": 4096.0,
        "colograd_phases_s": phases, "trl_phases_s": {"generate": 6.5}, "colograd_peak_rss_mib": 2048.0,
        "trl_peak_rss_mib": 1400.0,
    })  # fmt: skip
    assert "2 image prompts × 8 completions of exactly 256 tokens per step; medians of 5 steps after 2" in text
    assert "colograd   4.000 s/step  4,096 completion tokens/step" in text and "speedup_vs_trl 2.15" in text
    assert "after each side: colograd 2.5, TRL 3.3" in text
    assert "train      colograd    1.500   TRL        -" in text


def test_moe_flags_give_a_cpu_sized_moe_workload_of_fixed_length_completions():
    from colograd.bench.__main__ import MOE, build_parser, moe_workload
    from colograd.bench.shapes import MOE as BUILT
    from colograd.bench.shapes import MOE_SHAPE, build_task, expert_parameters, workload

    assert MOE == BUILT
    assert moe_workload(build_parser().parse_args(["moe"])) == {}
    w = workload(MOE)
    assert (w["prompts"], w["num_generations"], w["max_completion_length"], w["fixed_length"]) == (2, 8, 128, True)
    assert w["steps"] >= 3 and w["warmup"] >= 1  # medians of several steps after a warm-up
    args = build_parser().parse_args("moe --completion-tokens 64 --steps 3 --repeats 2 --dtype fp32".split())
    settings = moe_workload(args)
    assert settings == {"max_completion_length": 64, "steps": 3} and args.repeats == 2 and args.dtype == "fp32"
    for fixed in (["--model", "small"], ["--shape", "tiny"]):  # the model is the benchmark's own
        with pytest.raises(SystemExit):
            moe_workload(build_parser().parse_args(["moe", *fixed]))
    # vLLM's CPU expert kernel takes a hidden size (and, unpadded, an expert width) that is a multiple of 32.
    assert MOE_SHAPE["hidden_size"] % 32 == 0 and MOE_SHAPE["moe_intermediate_size"] % 32 == 0
    model = build_task(MOE, w)[0]
    config = model.config
    assert config.model_type == "qwen3_moe" and (config.num_experts, config.num_experts_per_tok) == (8, 2)
    experts = sum(p.numel() for _, p in expert_parameters(model))
    assert experts / sum(p.numel() for p in model.parameters()) > 0.8  # the experts are most of the bytes
    assert [n.rsplit(".", 1)[1] for n, _ in expert_parameters(model)][:2] == ["gate_up_proj", "down_proj"]


def test_moe_sides_train_the_same_model_and_generate_exactly_the_completion_length(tmp_path, monkeypatch):
    import trl
    from transformers import Qwen3MoeForCausalLM

    from colograd.bench import step
    from colograd.bench.shapes import MOE, build_task, workload

    seen = {}
    stand_in = _stand_in(seen)
    monkeypatch.setattr(step, "GRPOTrainer", stand_in)
    monkeypatch.setattr(trl, "GRPOTrainer", stand_in)
    w = {**workload(MOE, steps=1, warmup=0), "model": MOE, "dtype": "bf16"}
    with pytest.raises(_Stop):
        step.run_colograd(str(tmp_path), w)
    assert isinstance(seen["model"], Qwen3MoeForCausalLM) and seen["args"].bf16
    assert seen["args"].generation_kwargs == {"min_tokens": 128} and seen["args"].max_completion_length == 128
    with pytest.raises(_Stop):
        step.run_trl(str(tmp_path), w, mode="use_vllm=False (transformers generate)")
    loaded = Qwen3MoeForCausalLM.from_pretrained(seen["model"])  # TRL gets the same weights, saved
    for (name, a), (_, b) in zip(loaded.state_dict().items(), build_task(MOE, w)[0].state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    assert seen["args"].generation_kwargs == {"min_new_tokens": 128} and not seen["args"].use_vllm
    assert seen["args"].per_device_train_batch_size == 16 and seen["args"].bf16


def _moe_result() -> dict:
    """A MoE result as `run` returns it, with made-up figures, for the report's own formatting."""
    from colograd.bench.shapes import MOE, MOE_SHAPE, workload

    return {
        "workload": {**workload(MOE), "model": MOE, "dtype": "bf16"}, "shape": MOE_SHAPE,
        "trl_mode": "use_vllm=False (transformers generate)", "omp_wait_policy": "PASSIVE",
        "load_average_1min": {"colograd": 2.5, "trl": 3.3, "sync": 3.0},
        "colograd_step_s_median": 2.0, "trl_step_s_median": 4.5, "speedup_vs_trl": 2.25,
        "colograd_completion_tokens_per_step": 2048.0, "trl_completion_tokens_per_step": 2048.0,
        "colograd_phases_s": {"sync": 0.03, "generate": 0.7}, "trl_phases_s": {"generate": 2.6},
        "colograd_peak_rss_mib": 1900.0, "trl_peak_rss_mib": 1300.0, "peak_rss_ratio": 1900 / 1300,
        "sync_s": 0.030, "expert_sync_s": 0.014, "expert_copy_s": 0.005, "copy_s": 0.006, "sync_repeats": 7,
        "sync_vs_expert_copy": 6.0, "expert_sync_vs_expert_copy": 2.8, "sync_vs_copy": 5.0,
        "sync_bytes": 61003776, "expert_bytes": 50331648, "expert_tensors": 8, "engine_dtype": "bfloat16",
        "engine_path": "reload", "prepacked_experts": True, "parity_gap_before_sync": 3.4,
        "parity_gap_after_sync": 0.12,
    }  # fmt: skip


def test_moe_report_shows_medians_ratios_phases_and_the_sync_against_a_plain_copy():
    from colograd.bench.moe import report

    text = report(_moe_result())
    assert "Qwen3-MoE (4 layers, hidden 512, 8 experts of 256, top-2) in bf16, 2 prompts × 8 completions of " in text
    assert "exactly 128 tokens per step; medians of 5 steps after 2 warm-up steps" in text
    assert "colograd   2.000 s/step  2,048 completion tokens/step" in text and "speedup_vs_trl 2.25" in text
    assert "colograd 1,900 MiB, TRL 1,300 MiB, ratio 1.46" in text
    assert "sync       colograd    0.030   TRL        -" in text
    assert "whole model        30.00 ms for 58.2 MiB" in text and "experts alone      14.00 ms for 48.0 MiB" in text
    assert "plain copy_        5.00 ms of the expert bytes, 6.00 ms of every byte" in text
    assert "sync_vs_expert_copy 6.00 (goal: at most 2), expert_sync_vs_expert_copy 2.80" in text


def test_moe_run_reads_both_sides_and_the_sync_and_takes_their_ratios(monkeypatch, capsys):
    from colograd.bench import moe, vlm

    r = _moe_result()
    sides = {
        "colograd": {
            "step_s_median": 2.0,
            "completion_tokens_per_step": 2048.0,
            "phases_s": {},
            "peak_rss_mib": 1900.0,
        },
        "trl": {"step_s_median": 4.5, "completion_tokens_per_step": 2048.0, "phases_s": {}, "peak_rss_mib": 1000.0},
    }
    sync = {k: r[k] for k in r if k.startswith(("sync", "expert", "copy", "engine", "prepacked", "parity"))}
    workloads = []
    monkeypatch.setattr(vlm, "run_side", lambda side, w, env: workloads.append((side, w, env)) or sides[side])
    monkeypatch.setattr(moe, "run_sync_side", lambda w, repeats: workloads.append(("sync", w, repeats)) or sync)
    out = moe.run(dtype="fp32", as_json=True, repeats=3, steps=2)
    assert [side for side, _, _ in workloads] == ["colograd", "trl", "sync"]
    assert all(w["steps"] == 2 and w["dtype"] == "fp32" and w["model"] == "moe" for _, w, _ in workloads)
    assert workloads[0][2] == {"OMP_WAIT_POLICY": "PASSIVE"} and workloads[2][2] == 3
    assert out["speedup_vs_trl"] == 4.5 / 2.0 and out["peak_rss_ratio"] == 1.9
    assert out["sync_vs_expert_copy"] == 6.0 and json.loads(capsys.readouterr().out) == out


def test_interleaved_medians_time_every_function_in_turn():
    from colograd.bench.moe import interleaved_medians

    calls = []
    medians = interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # one untimed call each, then 3 rounds, taking turns
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


@pytest.mark.slow
def test_moe_sync_moves_the_experts_into_the_engine_and_is_timed_against_a_plain_copy():
    from colograd.bench.moe import measure_sync
    from colograd.bench.shapes import MOE, workload

    w = {**workload(MOE, max_completion_length=16), "model": MOE, "dtype": "fp32"}
    r = measure_sync(w, repeats=1)
    assert r["prepacked_experts"] and r["engine_dtype"] == "float32"
    # The moved weights reached the engine, prepacked: far apart before the syncs, the same model after.
    assert r["parity_gap_before_sync"] > 0.1 and r["parity_gap_after_sync"] < 1e-4
    assert r["expert_bytes"] == 12582912 * 4 and r["sync_bytes"] > r["expert_bytes"]
    assert r["sync_vs_expert_copy"] == pytest.approx(r["sync_s"] / r["expert_copy_s"])
    assert r["expert_sync_vs_expert_copy"] == pytest.approx(r["expert_sync_s"] / r["expert_copy_s"])


def test_workloads_refuse_accumulation_that_does_not_divide_the_step():
    from colograd.bench.shapes import workload
    from colograd.errors import ConfigError

    with pytest.raises(ConfigError, match="--accumulation 3 does not divide the step's 16 completions"):
        workload("tiny", gradient_accumulation_steps=3)
    with pytest.raises(ConfigError, match="--prompt-tokens"):
        workload("smollm2", prompt_tokens=64)


def test_sized_prompts_have_that_many_tokens_and_keep_the_task():
    from colograd.bench.shapes import letters_prompts
    from colograd.models import tiny

    tokenizer, plain = tiny.build_tokenizer(), tiny.letters_dataset(8)
    sized = letters_prompts(40, num_prompts=8)
    for row, original in zip(sized, plain, strict=True):
        assert len(tokenizer(row["prompt"])["input_ids"]) == 40
        assert row["prompt"].endswith(original["prompt"][-3:]) and row["target"] == original["target"]
    assert letters_prompts(None, num_prompts=8)["prompt"] == plain["prompt"]


def test_phase_peaks_charge_each_interval_to_its_innermost_phase(monkeypatch):
    from colograd.bench.peaks import PhasePeaks

    # What the allocator's peak since the last reset reads at each boundary (MiB), in the order they come: start-up,
    # TRL's rollout nested in its training step, the optimizer step, the report.
    readings = iter([100, 300, 900, 500, 400, 200, 50, 10])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(readings) * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 1000 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    peaks = PhasePeaks()
    peaks.enabled = True
    peaks.mark("startup")
    with peaks.phase("step"), peaks.phase("rollout"):
        pass
    with peaks.phase("optimizer"):
        pass
    report = peaks.report({"step": "train", "rollout": "logps"})
    assert next(readings, None) is None  # every boundary read the counter once
    # startup 100; step: 900 (entering the rollout) and 400 (leaving the step); rollout 500; optimizer 50 (leaving
    # it; 200 entering it was outside every phase)
    assert report["peak_gpu_mib_by_phase"] == {"startup": 100, "train": 900, "logps": 500, "optimizer": 50}
    assert report["peak_gpu_mib"] == 900 and report["peak_gpu_reserved_mib"] == 1000
    peaks.enabled = False  # no GPU: nothing measured, and None rather than zero
    assert peaks.report() == {"peak_gpu_mib": None, "peak_gpu_reserved_mib": None, "peak_gpu_mib_by_phase": None}


class _Stop(Exception):
    """Raised by a stand-in trainer once it has seen its arguments."""


def _stand_in(seen: dict) -> type:
    """A trainer class that records the arguments it is given in `seen`, then raises `_Stop`."""

    class StandIn:
        def __init__(self, model, **kwargs):
            seen.update(kwargs, model=model)
            raise _Stop

    return StandIn


def test_trl_side_loads_the_built_model_from_a_saved_folder(tmp_path, monkeypatch):
    import trl
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from colograd.bench import step
    from colograd.bench.shapes import build_task, workload

    seen = {}
    stand_in = _stand_in(seen)
    monkeypatch.setattr(trl, "GRPOTrainer", stand_in)
    w = {**workload("tiny", steps=1, warmup=0), "model": "tiny", "dtype": "fp32"}
    with pytest.raises(_Stop):
        step.run_trl(str(tmp_path), w, mode="use_vllm=True, vllm_mode=colocate")
    assert isinstance(seen["model"], str) and os.path.isdir(seen["model"])  # a path, not a model in memory
    loaded, built = Qwen2ForCausalLM.from_pretrained(seen["model"]), build_task("tiny", w)[0]
    assert loaded.dtype == torch.float32
    for (name, a), (_, b) in zip(loaded.state_dict().items(), built.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the weights colograd's side trains
    assert AutoTokenizer.from_pretrained(seen["model"]).chat_template == seen["processing_class"].chat_template
    args, defaults = seen["args"], trl.GRPOConfig.__dataclass_fields__
    assert args.use_vllm and args.vllm_mode == "colocate"
    assert args.vllm_gpu_memory_utilization == defaults["vllm_gpu_memory_utilization"].default  # TRL's own
    assert args.per_device_train_batch_size == 16 and args.max_completion_length == 96


def test_colograd_side_leaves_the_engine_memory_to_the_engine(tmp_path, monkeypatch):
    from colograd.bench import step
    from colograd.bench.shapes import workload
    from colograd.config.core import GRPOConfig

    seen = {}
    stand_in = _stand_in(seen)
    monkeypatch.setattr(step, "GRPOTrainer", stand_in)
    w = {**workload("tiny", prompt_tokens=100, steps=1, warmup=0), "model": "tiny", "dtype": "bf16"}
    with pytest.raises(_Stop):
        step.run_colograd(str(tmp_path), w)
    args = seen["args"]
    default = GRPOConfig.__dataclass_fields__["vllm_gpu_memory_utilization"].default
    assert args.vllm_gpu_memory_utilization == default and args.bf16
    # On a CPU, the cache the figures were measured with; the prompts fit.
    assert args.vllm_kv_cache_gib == 0.25 and args.max_prompt_length == 100
    assert args.per_device_train_batch_size == 16 and seen["model"].config.max_position_embeddings == 512
    assert json.loads(json.dumps(w)) == w  # the workload reaches each side's process as JSON


@pytest.mark.parametrize("tied", [False, True])
def test_decode_floor_reads_every_weight_once_and_the_kv_caches(tied):
    from colograd.bench.decode import decode_floor_seconds
    from colograd.models import tiny

    model = tiny.build_model(tie_word_embeddings=tied)
    # The tiny Qwen2: 2 layers of hidden 128, MLP 256, 2 heads of 64 (2 KV heads); vocabulary 64.
    layer = 4 * 128 * 128 + 3 * 128 + 3 * 128 * 256 + 2 * 128  # q, k, v, o; q, k, v biases; MLP; two norms
    embedding_rows = 4 * 128  # 4 sequences read one row each, unless the output layer reads it all anyway
    weights = 2 * layer + 128 + 64 * 128 + (0 if tied else embedding_rows)  # final norm, output layer
    kv = 4 * 10 * (2 * 2 * 2 * 64) * 2  # 4 sequences × 10 tokens × keys and values of 2 layers × 2 heads × 64, bf16
    floor = decode_floor_seconds(model, torch.bfloat16, sequences=4, context=10, bandwidth=1e9)
    assert floor == pytest.approx((2 * weights + kv) / 1e9)


@pytest.mark.slow
def test_decode_against_the_floor_and_generation_against_bare_vllm_through_the_trainers_engine(tmp_path, monkeypatch):
    from colograd import GRPOTrainer
    from colograd.bench import step
    from colograd.bench.decode import decode_against_floor
    from colograd.models import tiny

    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=16, num_generations=4)
    trainer = GRPOTrainer(model=tiny.build_model(), reward_funcs=tiny.letters_reward, args=args,
                          train_dataset=tiny.letters_dataset(8), processing_class=tiny.build_tokenizer())  # fmt: skip
    r = decode_against_floor(trainer, prompts=4)
    assert r["decode_sequences"] == 16
    assert r["memory_bandwidth_gb_s"] > 0.1 and r["decode_ms_per_step"] > 0
    # No engine decodes faster than its memory reads: the ratio is at least 1, whatever the machine.
    assert (
        r["decode_vs_floor"] == pytest.approx(r["decode_ms_per_step"] / r["decode_floor_ms"])
        and r["decode_vs_floor"] > 1
    )

    # Every call of the generation comparison ignores EOS: each decodes the same tokens (4 prompts × 4 × 8), and
    # the run's own settings are left as they were.
    calls = []
    generate = type(trainer.engine.llm).generate
    monkeypatch.setattr(
        type(trainer.engine.llm), "generate", lambda self, *a, **k: calls.append(generate(self, *a, **k)) or calls[-1]
    )
    g = step.generation_side_by_side(trainer, {"prompts": 4}, repeats=1)
    assert len(calls) == 4 and "ignore_eos" not in (trainer.args.generation_kwargs or {})
    assert [sum(len(s.token_ids) for o in out for s in o.outputs) for out in calls] == [
        4 * 4 * trainer.args.max_completion_length
    ] * 4
    assert g["generation_vs_bare_vllm"] == pytest.approx(
        g["colograd_generation_tokens_per_s"] / g["bare_vllm_tokens_per_s"]
    )
    assert g["generation_between_logs_vs_bare_vllm"] == pytest.approx(
        g["colograd_generation_between_logs_tokens_per_s"] / g["bare_vllm_tokens_per_s"]
    )
    # A step that logs asks for one completion's log-probs (the sampling-gap metric's); one between logs, none.
    logged, between = calls[0], calls[1]
    assert sum(s.logprobs is not None for o in logged for s in o.outputs) == 1
    assert all(s.logprobs is None for o in between for s in o.outputs)


def test_sharing_bench_times_every_packing_and_counts_their_tokens(monkeypatch, capsys):
    from colograd.bench import sharing

    monkeypatch.setattr(sharing, "segment_kernel", lambda *a: "reference")  # the GPU's segments, on a CPU
    r = sharing.run("tiny", prompts=2, prompt_tokens=40, generations=4, completion_tokens=8, repeats=1)
    names = ["unshared", "shared_mask", "unshared_segments", "shared_segments"]
    assert all(r[f"{name}_s"] > 0 for name in names) and r["unshared_vs_unshared"] == 1.0
    # Sharing computes each prompt once instead of 4 times: 3 copies of 40 tokens fewer per prompt.
    assert r["unshared_tokens"] - r["shared_mask_tokens"] == 2 * 3 * 40
    assert (
        r["shared_segments_tokens"] == r["shared_mask_tokens"]
        and r["unshared_segments_tokens"] == r["unshared_tokens"]
    )
    assert r["unshared_peak_mib"] is None  # no GPU memory to report on a CPU
    assert "shared_segments" in capsys.readouterr().out


def test_sharing_bench_reports_a_packing_that_runs_out_of_memory_and_runs_the_others(monkeypatch, capsys):
    from colograd.bench import sharing

    def logps(model, batch, **kwargs):
        if "share_prompts" not in kwargs:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 57.00 GiB")
        return real(model, batch, **kwargs)

    real = sharing.completion_logps
    monkeypatch.setattr(sharing, "completion_logps", logps)
    r = sharing.run("tiny", prompts=1, prompt_tokens=20, generations=2, completion_tokens=4, repeats=1)
    assert r["unshared_s"] == float("inf") and r["shared_mask_s"] > 0
    assert "unshared           out of memory" in capsys.readouterr().out


# --- the failure soak (`python -m colograd.bench soak`): its pure logic; its figures come from running it ---------


def test_soak_failure_names_the_rank_that_died_first_though_its_traceback_scrolled_off(tmp_path):
    from colograd.bench import soak

    log = tmp_path / "run.log"
    first = "[rank1]: FileNotFoundError: [Errno 2] No such file or directory: 'out/checkpoint-2'"
    then = "[rank0]: RuntimeError: Connection closed by peer"
    noise = "launcher noise\n" * 400  # the others' and the launcher's lines after it
    log.write_text(f"[rank1]: Traceback (most recent call last):\n{first}\n{noise}{then}\n")
    message = str(soak.fail("the relaunch ended", log))
    assert message.count(first) == 1 and message.count(then) == 1  # the cause said once, the tail's line not repeated
    assert message.index(first) < message.index(then)


def test_soak_kill_schedule_is_reproducible_and_spreads_one_failure_over_each_span():
    from colograd.bench.soak import kill_schedule

    schedule = kill_schedule(seed=7, steps=400, failures=3, nproc=2)
    assert schedule == kill_schedule(seed=7, steps=400, failures=3, nproc=2)  # the printed seed replays it
    assert schedule != kill_schedule(seed=8, steps=400, failures=3, nproc=2)
    # Steps 1 .. 398 in 3 spans: [1, 133], [134, 266], [267, 398]; the last leaves a step before the end.
    spans = [(1, 133), (134, 266), (267, 398)]
    assert all(lo <= kill.after_step <= hi for kill, (lo, hi) in zip(schedule, spans, strict=True))
    assert all(0 <= kill.delay < 1 and kill.rank in (0, 1) for kill in schedule)
    # As many failures as steps allow: one after each of steps 1 .. steps-2, in order.
    assert [k.after_step for k in kill_schedule(seed=1, steps=6, failures=4, nproc=1)] == [1, 2, 3, 4]
    assert kill_schedule(seed=1, steps=6, failures=0, nproc=2) == []
    ranks = {k.rank for k in kill_schedule(seed=3, steps=1000, failures=200, nproc=4)}
    assert ranks == {0, 1, 2, 3}  # any worker, never the launcher


def test_soak_settings_fill_the_defaults_and_refuse_bad_values_in_one_line():
    from colograd.bench.soak import DEFAULTS, settings

    s = settings(seed=5)
    assert s == {**DEFAULTS, "seed": 5}
    assert 0 <= settings()["seed"] < 2**31  # a fresh seed when none is given (printed by the run)
    assert settings(steps=10, save_steps=9, failures=8, nproc=1, launcher="accelerate", seed=0)["failures"] == 8
    refused = {
        "--steps 1: give at least 2 steps.": {"steps": 1},
        "--save-steps 0: give from 1 to 399 (below --steps 400)": {"save_steps": 0},
        "--save-steps 50: give from 1 to 49 (below --steps 50)": {"steps": 50, "save_steps": 50},
        "--failures 9: give from 0 to 8 (each failure comes after its own step among steps 1 to 8 of --steps 10)": {
            "steps": 10, "save_steps": 2, "failures": 9},
        "--failures -1: give from 0 to 398": {"failures": -1},
        "--nproc 0: give at least 1 process.": {"nproc": 0},
        "--seed -3: give a seed of 0 or more.": {"seed": -3},
        "--launcher 'mpirun': give one of torchrun, accelerate.": {"launcher": "mpirun"},
    }  # fmt: skip
    for message, values in refused.items():
        with pytest.raises(ValueError) as err:
            settings(**values)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_soak_command_line_runs_the_failure_soak_and_memory_the_memory_soak(monkeypatch, capsys):
    import sys

    from colograd.bench import __main__ as bench_main
    from colograd.bench import memory, soak

    assert bench_main.BENCHMARKS["soak"] == soak.__name__ and bench_main.BENCHMARKS["memory"] == memory.__name__
    ran = {}
    monkeypatch.setattr(soak, "run", lambda **kwargs: ran.update(kwargs))
    argv = ["python -m colograd.bench", "soak", "--steps", "60", "--failures", "1", "--seed", "9", "--json"]
    monkeypatch.setattr(sys, "argv", argv + ["--launcher", "accelerate"])
    bench_main.main()
    assert ran == {**soak.DEFAULTS, "steps": 60, "failures": 1, "seed": 9, "launcher": "accelerate",
                   "as_json": True}  # fmt: skip
    ran.clear()
    monkeypatch.setattr(sys, "argv", [*argv, "--save-steps", "60"])
    with pytest.raises(SystemExit) as err:  # refused before any launch
        bench_main.main()
    assert str(err.value).startswith("colograd.bench soak: --save-steps 60: give from 1 to 59") and not ran


def test_soak_reads_the_resume_note_and_the_step_lines_of_a_launchs_output():
    from colograd.bench.soak import logged_steps, resumed_step, steps_lost

    note = (
        "colograd: note: resuming from outputs/run/checkpoint-40, the newest finished checkpoint in outputs/run: it "
        "was saved by a run set up as this one (auto_resume); outputs/run/checkpoint-60 is incomplete (its "
        "trainer_state.json is missing or cut short: its save was interrupted)."
    )  # as docs/long-runs.md shows it
    assert resumed_step(note) == 40
    assert resumed_step("colograd: note: starting afresh, as no save of this run finished: removed its ...") is None
    assert resumed_step("{'loss': '-0.006', 'epoch': '0.0078'}") is None
    assert logged_steps("{'loss': '-0.00621', 'grad_norm': '0.5644', 'epoch': '0.007812'}\n") == 1
    assert logged_steps("Writing model shards: 100%|█| 1/1{'loss': '0.1', 'epoch': '1'}") == 1  # after a save's bar
    assert logged_steps("{'train_runtime': '2.468', 'train_loss': '-0.008275', 'epoch': '0.1562'}") == 0
    # Killed after step 57 was logged, checkpoint-50 the newest finished: steps 51 to 57 are trained again.
    assert steps_lost(57, 50) == 7 and steps_lost(50, 50) == 0


def test_soak_finds_the_first_step_whose_logged_metrics_differ_timings_aside():
    from colograd.bench.soak import first_divergent_step

    def history(losses, seconds):
        entries = [{"loss": loss, "reward": 0.5, "time/train": t, "throughput/train_tokens_per_s": 1 / t, "step": i}
                   for i, (loss, t) in enumerate(zip(losses, seconds, strict=True), 1)]  # fmt: skip
        return [*entries, {"train_runtime": sum(seconds), "step": len(losses)}]

    expected = history([0.1, 0.2, 0.3], [1.0, 1.0, 1.0])
    assert first_divergent_step(expected, history([0.1, 0.2, 0.3], [2.0, 0.5, 9.0])) is None  # timings differ only
    assert first_divergent_step(expected, history([0.1, 0.25, 0.3], [1.0, 1.0, 1.0])) == 2
    assert first_divergent_step(expected, history([0.1, 0.2], [1.0, 1.0])) == 3  # a step one run did not log


def test_soak_compares_the_final_weights_and_finds_the_first_checkpoint_that_differs(tmp_path):
    from safetensors.torch import save_file

    from colograd.bench.soak import compare

    def save(folder, weight, losses=None):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"w": weight, "b": torch.zeros(2)}, str(folder / "model.safetensors"))
        if losses is not None:  # a finished checkpoint, as transformers writes it (its state last)
            history = [{"loss": loss, "time/train": 0.1 * step, "step": step} for step, loss in enumerate(losses, 1)]
            state = {"global_step": len(losses), "log_history": history}
            (folder / "trainer_state.json").write_text(json.dumps(state))

    losses = [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]
    weights = {step: torch.full((2, 2), float(step)) for step in (2, 4, 6)}
    for run in ("uninterrupted", "soak"):
        for step, weight in weights.items():
            save(tmp_path / run / f"checkpoint-{step}", weight, losses[:step])
        save(tmp_path / run, weights[6])
    same = compare(tmp_path / "uninterrupted", tmp_path / "soak")
    assert same == {"bit_identical": True, "max_abs_diff": 0.0, "first_divergent_checkpoint": None,
                    "metrics_identical": True, "first_divergent_step": None, "compared_through_step": 6}  # fmt: skip

    off = weights[6].clone()
    off[0, 1] += 2**-20  # one element, by two units in the last place of a float32 6.0
    save(tmp_path / "soak", off)
    save(tmp_path / "soak/checkpoint-6", off, [*losses[:3], 0.25, 0.1, 0.0])
    save(tmp_path / "soak/checkpoint-4", weights[4] + 1e-3, losses[:4])
    differ = compare(tmp_path / "uninterrupted", tmp_path / "soak")
    assert not differ["bit_identical"] and differ["max_abs_diff"] == 2**-20
    assert differ["first_divergent_checkpoint"] == 4 and differ["compared_through_step"] == 6
    # From the newest checkpoint both saved: its log holds every step's metrics.
    assert not differ["metrics_identical"] and differ["first_divergent_step"] == 4


def test_soak_finds_a_launchers_worker_by_its_rank(tmp_path):
    import subprocess

    from colograd.bench.soak import worker_pid

    child = subprocess.Popen(["sleep", "30"], env={**os.environ, "RANK": "1"})
    try:
        assert worker_pid(os.getpid(), 1) == child.pid
        assert worker_pid(os.getpid(), 0) is None and worker_pid(child.pid, 1) is None
    finally:
        child.kill()
        child.wait()


def test_soak_report_says_what_each_failure_cost_and_whether_the_end_is_bit_identical():
    from colograd.bench.soak import report

    failure = {"killed_in_step": 58, "rank": 1, "launch_exit_code": 1, "checkpoint": 40, "resumed_from": 40,
               "steps_lost": 17, "exit_s": 0.4, "resume_s": 12.25}  # fmt: skip
    r = {
        "steps": 400, "save_steps": 20, "failures": 1, "nproc": 2, "launcher": "torchrun", "seed": 11,
        "failures_survived": 1, "failure_details": [failure], "steps_lost_total": 17, "steps_lost_max": 17,
        "steps_trained": 417, "resume_s": [12.25], "resume_s_median": 12.25, "fresh_first_step_s": 11.0,
        "with_failures_s": 90.0, "uninterrupted_s": 60.0, "bit_identical": True, "max_abs_diff": 0.0,
        "first_divergent_checkpoint": None, "metrics_identical": True, "first_divergent_step": None,
        "compared_through_step": 400,
        "load_average_1min_before": 0.5, "load_average_1min": 2.5, "output_dir": "outputs/bench-soak",
    }  # fmt: skip
    text = report(r)
    assert "400 steps of recipes/grpo_tiny.yaml on 2 processes under torchrun, a checkpoint every 20 steps" in text
    assert "1 failures (schedule seed 11)" in text
    assert "        1              58     1               40            40          17       0.4        12.2" in text
    assert "failures survived: 1 of 1; steps lost 17 in all, at most 17 for one (save interval 20)" in text
    assert "bit-identical to the uninterrupted run: yes (largest absolute weight difference 0.0)" in text
    assert "through step 400: identical at every step" in text
    text = report({**r, "bit_identical": False, "max_abs_diff": 3e-8, "first_divergent_checkpoint": 60,
                   "first_divergent_step": 41})  # fmt: skip
    assert "bit-identical to the uninterrupted run: no: largest absolute weight difference 3e-08; first " in text
    assert "checkpoint whose weights differ: 60" in text and "first differ at step 41" in text
    text = report({**r, "metrics_identical": False, "first_divergent_step": 131})  # other batches, no gradient
    assert "first differ at step 131 (the weights agree all the same: where every group's rewards are equal" in text


@pytest.mark.slow  # three 2-process torchrun launches: the soak's killed one, its relaunch, the uninterrupted run
def test_soak_with_one_failure_resumes_and_ends_bit_identical(tmp_path, monkeypatch, capsys):
    from colograd.bench import soak

    monkeypatch.chdir(tmp_path)  # outputs/bench-soak under it
    r = soak.run(steps=6, save_steps=2, failures=1, seed=4, as_json=True)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == r
    (f,) = r["failure_details"]
    assert r["failures_survived"] == 1 and f["launch_exit_code"] != 0
    assert f["checkpoint"] == f["resumed_from"] and 0 <= f["steps_lost"] <= 2 and f["resume_s"] > 0
    assert r["steps_trained"] == 6 + f["steps_lost"]
    assert r["bit_identical"] and r["max_abs_diff"] == 0.0 and r["metrics_identical"]
    assert (tmp_path / "outputs/bench-soak/result.json").exists()
