"""The engine's log-probs of its samples: asked for every request only when the loss reads them, else for one
completion per rank (the sampling-gap metric's)."""

import math

import pytest
import torch
from torch._dynamo.utils import counters

from colograd.config.core import GRPOConfig
from colograd.engine.core import Engine
from colograd.engine.requests import Sampling, rollout_requests, sampling_params
from colograd.engine.sampler_tap import SamplerTap
from colograd.engine.sync import WeightPlan
from colograd.gpu.check import trainer_logprobs
from colograd.models import tiny

pytestmark = pytest.mark.slow

SETTINGS = dict(per_device_train_batch_size=12, num_generations=4, max_prompt_length=16, max_completion_length=8,
                vllm_enforce_eager=True, report_to="none")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """The tiny model, its tokenizer and an engine holding its weights (one engine for the module's tests)."""
    torch.manual_seed(0)
    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    engine = Engine(model, tokenizer, GRPOConfig(output_dir=str(tmp_path_factory.mktemp("engine")), **SETTINGS))
    WeightPlan(model).sync(engine)
    return model, tokenizer, engine


def test_log_probs_only_where_consumed(tiny_engine, tmp_path, monkeypatch):
    """Defaults (on-policy, no correction): the first prompt's first completion carries log-probs for the
    sampling-gap metric (asked alone, its group still G completions), every other completion NaN; with the
    importance-sampling correction every completion carries them, read from the sampler's tensors. Where given,
    they are the trainer's log-probs of the same tokens."""
    model, tokenizer, engine = tiny_engine
    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS)
    corrected = GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_correction=True, **SETTINGS)
    prompts = [tokenizer(p)["input_ids"] for p in ("abcd>b:", "dcba>c:", "bbad>a:")]

    frames = dict(counters["frames"])
    rollout = engine.generate(prompts, Sampling.of(args))
    assert dict(counters["frames"]) == frames  # the CPU sampler counted ranks without compiling (engine_cpu)
    asked = [not any(math.isnan(v) for v in logps) for logps in rollout.logps]
    assert asked == [True] + [False] * 11
    assert rollout.asked == asked  # recorded: a NaN in an asked completion would be the engine's own
    assert all(all(math.isnan(v) for v in logps) for logps in rollout.logps[1:])
    assert engine.generate(prompts, Sampling.of(args), gap_sample=False).asked == [False] * 12
    assert [len(v) for v in rollout.logps] == [len(ids) for ids in rollout.completion_ids]
    expected = trainer_logprobs(model, prompts[0] + rollout.completion_ids[0])[len(prompts[0]) - 1 :]
    assert torch.tensor(rollout.logps[0]).sub(expected).abs().max() < 1e-4

    rollout = engine.generate(prompts, Sampling.of(corrected))
    assert isinstance(engine._tap, SamplerTap)  # read from the sampler, with no per-token objects
    assert all(not any(math.isnan(v) for v in logps) for logps in rollout.logps) and rollout.asked == [True] * 12
    for i, (ids, logps) in enumerate(zip(rollout.completion_ids, rollout.logps, strict=True)):
        sequence = prompts[i // 4] + ids
        expected = trainer_logprobs(model, sequence)[len(prompts[i // 4]) - 1 :]
        assert torch.tensor(logps).sub(expected).abs().max() < 1e-4

    # A capture the tap cannot assemble: one warning line, the rollout sampled again with vLLM's objects, tap off.
    missed = []
    monkeypatch.setattr(SamplerTap, "logps", lambda self, outputs: missed.append(1))
    rollout = engine.generate(prompts, Sampling.of(corrected))
    assert missed == [1] and engine._tap is None
    assert len(rollout.logps) == 12 and all(not any(math.isnan(v) for v in logps) for logps in rollout.logps)


def test_the_metric_completion_asked_alone_keeps_the_seeds_of_its_group(tiny_engine, tmp_path):
    """Seeded requests (as under tensor parallelism): the group whose first completion asks for log-probs in a
    request of its own (`rollout_requests`) samples the same tokens as one request of n = G, completion by
    completion."""
    _, tokenizer, engine = tiny_engine
    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS)
    prompt = engine.prompt(tokenizer("abcd>b:")["input_ids"])
    whole = engine.llm.generate([prompt], sampling_params(args, 1234, logprobs=None), use_tqdm=False)[0].outputs
    requests = rollout_requests(Sampling.of(args), [1234], 1, [4])
    assert [(i, p.n, p.seed, p.logprobs) for i, p in requests] == [(0, 1, 1234, 0), (0, 3, 1235, None)]
    split = [engine.llm.generate([prompt], p, use_tqdm=False)[0].outputs for _, p in requests]
    assert [list(s.token_ids) for s in whole] == [list(s.token_ids) for s in split[0] + split[1]]
    assert len({tuple(s.token_ids) for s in whole}) > 1  # the seeds differ per completion


@pytest.mark.parametrize(
    "logging, steps, expected",
    [
        (dict(logging_steps=1), {}, [True] * 6),
        (dict(logging_steps=3), {}, [False, False, True, False, False, True]),
        (dict(logging_steps=4, logging_first_step=True), {}, [True, False, False, True, False, True]),  # 6 is last
        (dict(logging_steps=4), dict(steps_per_generation=2, gradient_accumulation_steps=1), [False, True, True]),
        (dict(logging_steps=4, logging_strategy="no"), {}, [True] * 6),
    ],
)
def test_a_rollout_asks_for_the_gap_sample_only_when_a_step_it_trains_logs(logging, steps, expected, tmp_path):
    """The rollouts of a 6-step run: one asks when an optimizer step it trains logs. With two micro-steps per
    rollout and one per optimizer step, a rollout trains two steps (1-2, 3-4, 5-6: 4 logs, 6 is the last)."""

    from transformers import TrainerState

    from colograd.rollout.core import gap_sampling

    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS | steps | logging)
    span = args.steps_per_generation // args.gradient_accumulation_steps  # optimizer steps per rollout
    asked = []
    for step in range(0, 6, span):  # the optimizer steps done when each rollout starts
        state = TrainerState(global_step=step, max_steps=6, logging_steps=args.logging_steps)
        asked.append(gap_sampling(args, state, comparing=False)[0])
    assert asked == expected
    state = TrainerState(global_step=1, max_steps=6, logging_steps=args.logging_steps)
    # An evaluation's rollout always asks, and so does one the parity guard compares (the gate's first, a recheck).
    assert gap_sampling(args, state, comparing=False, evaluation=True)[0]
    assert gap_sampling(args, state, comparing=True)[0]


def test_an_image_runs_gap_turn_moves_on_by_one_at_each_rollout_that_logs(tmp_path):
    """The rotation of the metric's prompt is the rollout's logging window: 0, 1, 2 ... at the rollouts that ask,
    whatever the logging period, and the same for the same step after a resume (nothing counted in the trainer)."""
    from transformers import TrainerState

    from colograd.rollout.core import gap_sampling

    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS | dict(logging_steps=3))
    turns = []
    for step in range(12):
        state = TrainerState(global_step=step, max_steps=100, logging_steps=3)
        asks, turn = gap_sampling(args, state, comparing=False)
        if asks:
            turns.append(turn)
    assert turns == [1, 2, 3, 4]


def test_between_logging_steps_no_request_asks_and_the_metric_is_logged_where_steps_log(tmp_path, monkeypatch):
    """logging_steps=2 over 4 steps: the rollout of step 3 asks the engine for no log-prob, those of steps 2 and 4 for
    the metric's one completion, and so does step 1's, the parity gate's (`colograd.grpo.parity`); the logged entries
    carry the sampling gap."""
    import colograd.engine.core
    from colograd import GRPOTrainer

    asked = []
    requests = colograd.engine.core.rollout_requests
    monkeypatch.setattr(
        colograd.engine.core,
        "rollout_requests",
        lambda *a: asked.append(sum(p.logprobs is not None for _, p in requests(*a))) or requests(*a),
    )
    trainer = GRPOTrainer(
        model=tiny.build_model(),
        reward_funcs=tiny.letters_reward,
        args=tiny.run_config(str(tmp_path), steps=4, logging_steps=2, per_device_train_batch_size=16),
        train_dataset=tiny.letters_dataset(64),
        processing_class=tiny.build_tokenizer(),
    )
    trainer.train()
    assert asked == [1, 1, 0, 1]
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [2, 4]
    assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in steps)


def test_tokens_the_engine_could_not_score_take_the_trainers_old_log_probs():
    """With the engine's log-probs standing in for the sampling policy's, a token it could not score (NaN: the tap
    missed an agent's turns) takes the trainer's log-prob at the same weights; a NaN old log-prob would make the loss
    and every gradient NaN. The trainer's pass runs only when some token is unscored."""
    from colograd.grpo.loss import engine_old_logps, policy_loss

    torch.manual_seed(0)
    trainer_NT = torch.randn(4, 6).log_softmax(-1)
    engine_NT = trainer_NT + 1e-3 * torch.randn(4, 6)
    mask_NT, advantages_N = torch.ones(4, 6), torch.tensor([1.0, -1.0, 0.5, -0.5])
    calls = []
    assert engine_old_logps(engine_NT, lambda: calls.append(1) or trainer_NT) is engine_NT and not calls
    engine_NT[1, 2:4] = float("nan")  # an agent's turn the tap missed
    logps_NT = trainer_NT.clone().requires_grad_()
    naive = policy_loss(logps_NT, engine_NT, advantages_N, mask_NT, num_items=mask_NT.sum()).loss
    assert naive.isnan()  # what the guard prevents
    old_NT = engine_old_logps(engine_NT, lambda: trainer_NT)
    assert torch.equal(old_NT[1, 2:4], trainer_NT[1, 2:4]) and torch.equal(old_NT[0], engine_NT[0])
    loss = policy_loss(logps_NT, old_NT, advantages_N, mask_NT, num_items=mask_NT.sum()).loss
    loss.backward()
    assert loss.isfinite() and logps_NT.grad.isfinite().all()
