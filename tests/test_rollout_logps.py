"""The engine's log-probs of its samples: asked for every request only when the loss reads them."""

import math

import pytest
import torch

from colograd import tiny
from colograd.check import trainer_logprobs
from colograd.config import GRPOConfig
from colograd.engine import Engine
from colograd.sampler_tap import SamplerTap
from colograd.sync import WeightPlan

pytestmark = pytest.mark.slow


def test_log_probs_only_where_consumed(tmp_path, monkeypatch):
    """Defaults (on-policy, no correction): the first prompt's group carries log-probs for the sampling-gap metric,
    every other completion NaN; with the importance-sampling correction every completion carries them, read from the
    sampler's tensors. Where given, they are the trainer's log-probs of the same tokens."""
    torch.manual_seed(0)
    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    settings = dict(per_device_train_batch_size=12, num_generations=4, max_prompt_length=16, max_completion_length=8,
                    vllm_enforce_eager=True, report_to="none")  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp_path), **settings)
    corrected = GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_correction=True, **settings)
    engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    prompts = [tokenizer(p)["input_ids"] for p in ("abcd>b:", "dcba>c:", "bbad>a:")]

    rollout = engine.generate(prompts, args)
    asked = [not any(math.isnan(v) for v in logps) for logps in rollout.logps]
    assert asked == [True] * 4 + [False] * 8
    assert all(all(math.isnan(v) for v in logps) for logps in rollout.logps[4:])
    assert [len(v) for v in rollout.logps] == [len(ids) for ids in rollout.completion_ids]

    rollout = engine.generate(prompts, corrected)
    assert isinstance(engine._tap, SamplerTap)  # read from the sampler, with no per-token objects
    assert all(not any(math.isnan(v) for v in logps) for logps in rollout.logps)
    for i, (ids, logps) in enumerate(zip(rollout.completion_ids, rollout.logps, strict=True)):
        sequence = prompts[i // 4] + ids
        expected = trainer_logprobs(model, sequence)[len(prompts[i // 4]) - 1 :]
        assert torch.tensor(logps).sub(expected).abs().max() < 1e-4

    # A capture the tap cannot assemble: one warning line, the rollout sampled again with vLLM's objects, tap off.
    missed = []
    monkeypatch.setattr(SamplerTap, "logps", lambda self, outputs: missed.append(1))
    rollout = engine.generate(prompts, corrected)
    assert missed == [1] and engine._tap is None
    assert len(rollout.logps) == 12 and all(not any(math.isnan(v) for v in logps) for logps in rollout.logps)
