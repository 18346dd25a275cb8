"""Routing replay, the trainer's half (`colograd.forward.router.RoutingReplay`): on every forward layout (packed, in
rows, prompts shared, padded) the model's routers pick the experts a rollout's `routed_experts` give, position by
position, for every family whose router takes a top-k (DeepSeek's and GLM's group-limited routing with its correction
bias included); replaying the model's own routing changes nothing, a routing shifted by one token changes the
log-probs, gradients still reach the routers, the metric counts what differed, and nothing is replayed outside the
passes that set it."""

import pytest
import torch
import zoo
from test_router import PASSES, moe_model, rollout
from transformers import AutoModelForCausalLM

from colograd.errors import ConfigError
from colograd.forward.logps import PromptSharing, completion_logps
from colograd.forward.packing import prompt_sharing_cost
from colograd.forward.router import UNREAD, RouterRecord, RoutingReplay, check_replay, router_of
from colograd.models import tiny

QWEN3_MOE, MIXTRAL, DEEPSEEK_V3 = (
    "Qwen/Qwen3-30B-A3B",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "deepseek-ai/DeepSeek-V3",
)
FAMILIES = [
    MIXTRAL,
    pytest.param(DEEPSEEK_V3, marks=pytest.mark.slow),  # groups, a correction bias, sigmoid scores
    pytest.param(QWEN3_MOE, marks=pytest.mark.slow),
    pytest.param("allenai/OLMoE-1B-7B-0924-Instruct", marks=pytest.mark.slow),
    pytest.param("deepseek-ai/DeepSeek-V2-Lite", marks=pytest.mark.slow),
    pytest.param("zai-org/GLM-4.5-Air", marks=pytest.mark.slow),
    pytest.param("openai/gpt-oss-20b", marks=pytest.mark.slow),
    pytest.param("ibm-granite/granite-4.0-h-tiny", marks=pytest.mark.slow),  # Tensor.topk on its logits
    pytest.param("LiquidAI/LFM2-8B-A1B", marks=pytest.mark.slow),
]


def model_of(name: str) -> torch.nn.Module:
    if name in zoo.HYBRIDS:
        model, _ = zoo.stopping_model(name)
        return model.float().eval()
    return moe_model(name)


def own_routing(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The experts each router of `model` picks for each position of `batch` run padded, [N, P + T, layers, k]: the
    integer output of each router, whichever place its family returns it in."""
    router = router_of(model, 0.0)
    picked = []

    def hook(module, args, output):
        picked.append(next(o for o in output if not o.is_floating_point() and o.size(-1) == router.top_k))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router.router_class)]
    with torch.no_grad():
        model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    for handle in handles:
        handle.remove()
    n, width = batch["input_ids"].shape
    return torch.stack(picked, dim=1).view(n, width, len(picked), router.top_k).to(torch.int16)


def logps(model, batch, replay, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return completion_logps(model, batch, replay=replay, **kwargs)


def layouts(model) -> dict[str, dict]:
    out = {}
    for name, kwargs in PASSES.items():
        if kwargs.get("share_prompts") == "cost":
            kwargs = {**kwargs, "share_prompts": PromptSharing(prompt_sharing_cost(model))}
        out[name] = kwargs
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_replaying_a_models_own_routing_changes_nothing_and_a_shifted_one_does(name):
    """The model's own routing replayed gives its log-probs (to float rounding), while the same routing shifted by
    one position (the error a misaligned capture makes) moves them: the check has power. Every layout for Mixtral
    (the layouts are the trainer's, whatever the family); the family's router, padded, for the rest."""
    model = model_of(name)
    batch = rollout(model.config.vocab_size, groups=2, size=3)
    own = own_routing(model, batch)
    replay = RoutingReplay(router_of(model, 0.0), [model])
    mask = batch["completion_mask"].bool()
    for layout, kwargs in layouts(model).items():
        if layout != "padded" and name != MIXTRAL:
            continue
        plain = logps(model, batch, None, **kwargs)
        same = logps(model, {**batch, "routed_experts": own}, replay, **kwargs)
        assert (same - plain)[mask].abs().max() < 1e-5, layout
        assert replay.take()["moe/routing_replay/differed"] < 1e-3, layout  # an exact tie may pick either
        shifted = logps(model, {**batch, "routed_experts": own.roll(1, dims=1)}, replay, **kwargs)
        assert (shifted - plain)[mask].abs().max() > 1e-2, layout
        assert replay.take()["moe/routing_replay/differed"] > 0.3, layout


def test_the_routers_pick_the_given_experts_and_route_the_rest_themselves():
    """Random experts given on some positions, none (-1) on others: each router's chosen experts are the given
    ones where given and its own elsewhere; the metrics count the choices that differed and those not given, over
    the tokens (padding excluded)."""
    model = model_of(MIXTRAL)
    batch = rollout(model.config.vocab_size, groups=2, size=3)
    own = own_routing(model, batch)
    n, width, layers, k = own.shape
    experts = router_of(model, 0.0).num_experts
    gen = torch.Generator().manual_seed(1)
    given = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n * width * layers)])
    given = given.view(n, width, layers, k).to(torch.int16)
    unknown = torch.rand(n, width, generator=gen) < 0.25
    given[unknown] = -1
    given[batch["attention_mask"] == 0] = UNREAD
    router = router_of(model, 0.0)
    replay = RoutingReplay(router, [model])
    replay.use(given.flatten(0, 1).long())
    with RouterRecord(router).recording(model) as logits:
        picked = own_routing(model, batch)  # the padded forward, replayed
    replay.use(None)
    metrics = replay.take()
    real = batch["attention_mask"].bool()
    known = real & ~unknown
    assert torch.equal(picked[known].sort(-1).values, given[known].sort(-1).values)
    # Elsewhere the router's own choice: in the first layer that of the model unreplayed (later layers read what the
    # replayed layers before them computed).
    assert torch.equal(picked[~known & real][:, 0], own[~known & real][:, 0])
    tokens = real.sum().item()
    assert metrics["moe/routing_replay/unreplayed"] == pytest.approx((unknown & real).sum().item() / tokens)
    # What each router would have chosen in this pass (its logits are still its own).
    would = torch.stack([layer.topk(k).indices for layer in logits], dim=1).view(n, width, layers, k)
    differed = (would[known].sort(-1).values != given[known].sort(-1).values).any(-1).sum().item()
    assert metrics["moe/routing_replay/differed"] == pytest.approx(differed / (tokens * layers))
    assert replay.take() == {}  # counted once


def test_gradients_reach_the_routers_and_a_recomputed_layer_routes_as_its_forward():
    """A replayed training pass: the routers get a gradient (the weights of the given experts are theirs), and with
    gradient checkpointing (each layer run again in the backward) the gradients are those of the same pass without
    it, because the routing stays set until the slice is done."""
    grads = []
    for checkpointing in (False, True):
        model = model_of(MIXTRAL).train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        batch = rollout(model.config.vocab_size, groups=2, size=3)
        given = own_routing(model, batch).roll(1, dims=1)
        replay = RoutingReplay(router_of(model, 0.0), [model])
        with replay.cleared():
            out = completion_logps(model, {**batch, "routed_experts": given}, replay=replay)
            (out * batch["completion_mask"]).sum().backward()
        assert replay.routes is None
        gates = [m.weight.grad for m in model.modules() if isinstance(m, router_of(model, 0.0).router_class)]
        assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_no_forward_outside_the_passes_replays():
    """A pass without gradients clears its routing; any other forward of the model routes by itself."""
    model = model_of(MIXTRAL)
    batch = rollout(model.config.vocab_size, groups=1, size=2)
    own = own_routing(model, batch)
    replay = RoutingReplay(router_of(model, 0.0), [model])
    logps(model, {**batch, "routed_experts": own.roll(1, dims=1)}, replay)
    assert replay.routes is None
    assert torch.equal(own_routing(model, batch), own)
    with pytest.raises(ValueError, match="the engine routed 3 MoE layers and the trainer's model has 2 routers"):
        replay.use(torch.zeros(5, 3, 2, dtype=torch.long))  # an engine with a layer more: no layer is matched
    replay.remove()
    replay.use(own.roll(1, dims=1).flatten(0, 1).long())  # removed: set routing reaches no router
    assert torch.equal(own_routing(model, batch), own)


def test_a_router_without_a_top_k_over_its_experts_stops_the_pass():
    """Phi-3.5-MoE's sparse mixer picks its two experts by masked maxima, not a top-k: replay cannot answer it, and
    the pass stops in one line instead of training on the router's own choice."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo.shrunk("microsoft/Phi-3.5-MoE-instruct")).eval()
    batch = rollout(model.config.vocab_size, groups=1, size=2)
    router = router_of(model, 0.0)
    replay = RoutingReplay(router, [model])
    routes = torch.zeros(*batch["input_ids"].shape, model.config.num_hidden_layers, router.top_k, dtype=torch.int16)
    with pytest.raises(ValueError, match="chose its experts without a top-k .* cannot be replayed; set routing_repl"):
        logps(model, {**batch, "routed_experts": routes}, replay, padding_free=False)
    # At set-up already, from its first router alone; a family that replays passes the probe.
    with pytest.raises(ConfigError, match="PhimoeTopKRouter chose its experts without a top-k over its 16 experts"):
        replay.probe(model)
    mixtral = model_of(MIXTRAL)
    RoutingReplay(router_of(mixtral, 0.0), [mixtral]).probe(mixtral)


def test_replay_is_refused_where_it_cannot_apply(tmp_path, monkeypatch):
    args = tiny.run_config(str(tmp_path), 1, routing_replay="rollout")
    dense = tiny.build_model()
    with pytest.raises(ConfigError, match="is not a Mixture-of-Experts model with routers to replay"):
        check_replay(args, router_of(dense, None), dense, rollout_func=False)
    moe = model_of(MIXTRAL)
    with pytest.raises(ConfigError, match="with a rollout_func: the function generates"):
        check_replay(args, router_of(moe, None), moe, rollout_func=True)
    check_replay(args, router_of(moe, None), moe, rollout_func=False)  # tools and environments are replayed
    with pytest.raises(ConfigError, match="routing_replay='on' is unknown; use 'off' or 'rollout'"):
        tiny.run_config(str(tmp_path), 1, routing_replay="on")
    # Partial rollouts replay piece by piece on the CPU engine's capture; a GPU engine's own route returns a
    # completion's routing only once it finishes, so there they are refused together.
    both = tiny.run_config(str(tmp_path), 1, routing_replay="rollout", partial_rollouts=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check, as a GPU machine's start-up runs it
    with pytest.raises(ConfigError, match="^routing_replay=rollout with partial_rollouts on a GPU: .*set one of"):
        both.check_regularizers()


def test_the_batch_holds_the_routing_beside_the_tokens():
    """`pad_rollout` places each completion's routing (prompt, then completion) where its tokens are: -1 where the
    engine did not route, `UNREAD` on padding and on a last token the engine did not route (nothing reads it)."""
    from colograd.engine.rollout import Rollout
    from colograd.forward.batch import pad_rollout

    prompts = [[5, 6, 7], [8, 9]]
    completions = [[1, 2], [3], [4, 4, 4], [2]]
    routed = [torch.arange(len(prompts[i // 2]) + len(c)).repeat_interleave(2).view(-1, 1, 2).to(torch.int16)
              for i, c in enumerate(completions)]  # fmt: skip
    routed[1][1] = -1  # a prompt position the engine did not route: the trainer routes it
    routed[1][-1] = -1  # the last token, which the engine never computes: nobody reads it
    rollout_ = Rollout(completions, [[0.0] * len(c) for c in completions], [False] * 4, routed=routed)
    batch = pad_rollout(prompts, rollout_, torch.zeros(4), 2, 0)
    routes = batch["routed_experts"][..., 0, 0]
    assert routes.shape == (4, 3 + 3)
    assert routes[0].tolist() == [0, 1, 2, 3, 4, UNREAD]
    assert routes[2].tolist() == [UNREAD, 0, 1, 2, 3, 4]
    assert routes[1].tolist() == [0, -1, 2, UNREAD, UNREAD, UNREAD]
    assert ((routes != UNREAD) == batch["attention_mask"].bool())[[0, 2, 3]].all()
