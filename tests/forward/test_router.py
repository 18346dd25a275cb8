"""A Mixture-of-Experts router's load-balancing loss as TRL adds it (`colograd.forward.router`): the loss colograd
computes on packed and prompt-shared passes is the one the model computes on the same sequences padded (TRL's
forward), TRL's rule for the coefficient, and the experts' load."""

import pytest
import torch
import zoo
from transformers import AutoModelForCausalLM

from colograd.errors import ConfigError
from colograd.forward.logps import PromptSharing, completion_logps
from colograd.forward.packing import prompt_sharing_cost
from colograd.forward.router import RouterRecord, router_of
from colograd.models import tiny

QWEN3_MOE, MIXTRAL, OLMOE, DEEPSEEK = (
    "Qwen/Qwen3-30B-A3B",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "allenai/OLMoE-1B-7B-0924-Instruct",
    "deepseek-ai/DeepSeek-V2-Lite",
)
P, T = 48, 64  # prompt and completion widths of the padded rollout


def moe_model(name: str) -> torch.nn.Module:
    """`name`'s shrunk model with sharp weights: its routers favour some experts, as trained ones do."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo.shrunk(name)).eval()
    zoo.sharpen(model)
    return model


def rollout(vocab: int, groups: int = 3, size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout as `pad_rollout` lays it out: `groups` prompts of lengths from 9 to 48, each with `size`
    completions of lengths from 1 to 64, left- and right-padded."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    ids = torch.randint(3, vocab, (n, P + T), generator=gen)
    mask = torch.zeros(n, P + T, dtype=torch.long)
    for g in range(groups):
        prompt = int(torch.randint(9, P + 1, (1,), generator=gen))
        for i in range(g * size, (g + 1) * size):
            ids[i, :P] = ids[g * size, :P]
            completion = T if i == 0 else int(torch.randint(1, T + 1, (1,), generator=gen))
            mask[i, P - prompt : P + completion] = 1
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": ids[:, P:],
        "completion_mask": mask[:, P:],
    }


def trl_aux_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss TRL adds: the model's own, on the padded sequences with their attention mask."""
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_router_logits=True,
        )
    return out.aux_loss


def colograd_aux_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs) -> RouterRecord:
    record = RouterRecord(router_of(model, None))
    with torch.no_grad():
        completion_logps(model, batch, router=record, **kwargs)
    return record


PASSES = {
    "packed": {"padding_free": True},
    "packed-rows": {"padding_free": True, "row_tokens": 200},
    "shared-prompts": {"padding_free": True, "share_prompts": "cost"},
    "padded": {"padding_free": False},
}


@pytest.mark.parametrize(
    "name", [MIXTRAL, pytest.param(QWEN3_MOE, marks=pytest.mark.slow), pytest.param(OLMOE, marks=pytest.mark.slow)]
)
def test_the_router_loss_is_trls_on_every_forward_layout(name):
    """Packed (one row, or rows of 200 tokens), prompts shared, padded: each the loss of TRL's padded forward."""
    model = moe_model(name)
    batch = rollout(model.config.vocab_size)
    expected = trl_aux_loss(model, batch)
    # The check has power: counting the padding (the model's loss without its mask) moves the loss far more.
    with torch.no_grad():
        unmasked = model(input_ids=batch["input_ids"], output_router_logits=True).aux_loss
    for layout, kwargs in PASSES.items():
        if kwargs.get("share_prompts") == "cost":
            kwargs = {**kwargs, "share_prompts": PromptSharing(prompt_sharing_cost(model))}
        record = colograd_aux_loss(model, batch, **kwargs)
        assert record.aux_loss is not None
        error = (record.aux_loss - expected).abs()
        assert error <= 1e-5 * expected, (layout, record.aux_loss, expected)
        assert (unmasked - expected).abs() > 100 * error.clamp(min=1e-7), layout


def test_a_shared_prompt_counts_once_per_completion():
    """With prompts shared, a prompt's tokens are computed once but weigh for each completion, as in TRL's padded
    forward; weighing them once gives another loss."""
    model = moe_model(MIXTRAL)
    batch = rollout(model.config.vocab_size, groups=2, size=8)
    sharing = PromptSharing(prompt_sharing_cost(model))
    record = colograd_aux_loss(model, batch, padding_free=True, share_prompts=sharing)
    expected = trl_aux_loss(model, batch)
    assert torch.allclose(record.aux_loss, expected, rtol=1e-5)
    # The same tokens, each prompt once: the sequences deduplicated to one completion per group and the rest
    # without their prompt is not expressible as a batch, so weigh the shared pass's positions by 1 instead.
    router = router_of(model, None)
    flat = RouterRecord(router)
    with torch.no_grad(), flat.recording(model) as logits:
        from colograd.forward.logps import pack_shared

        packed = pack_shared(batch, sharing.attention_cost)
        model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=packed.attention_mask)
    flat.finish(logits, (packed.weights > 0).float())
    assert (flat.aux_loss - expected).abs() > 1e-4 * expected


def test_trls_rule_for_the_coefficient():
    moe = moe_model(QWEN3_MOE)
    assert router_of(moe, None).coef == moe.config.router_aux_loss_coef == 0.001  # the config's own
    assert router_of(moe, 0.05).coef == 0.05
    assert router_of(moe, 0.0).coef == 0.0  # off: the load is still read
    mixtral = moe_model(MIXTRAL)
    assert (router_of(mixtral, None).num_experts, router_of(mixtral, None).top_k) == (8, 2)
    dense = tiny.build_model()
    assert router_of(dense, None) is None and router_of(dense, 0.0) is None
    with pytest.raises(ConfigError, match="router_aux_loss_coef is 0.01 but .* is not a Mixture-of-Experts"):
        router_of(dense, 0.01)
    # DeepSeek-V2: router logits, but no load-balancing loss in transformers' code and no coefficient in its config.
    deepseek = moe_model(DEEPSEEK)
    assert router_of(deepseek, None).coef == 0.0 and router_of(deepseek, None).num_experts == 64
    with pytest.raises(ConfigError, match="has no load-balancing loss to add; set router_aux_loss_coef: 0"):
        router_of(deepseek, 0.01)


def test_a_vision_language_moe_adds_its_own_load_balancing_loss():
    """Qwen3.5's MoE as its checkpoints are published (`Qwen3_5MoeForConditionalGeneration`) reads its experts and
    coefficient from its text config, where its causal LM holds them itself: the run takes the coefficient of the
    config and computes the model's own loss. (It was refused in one line, "has no load-balancing loss to add",
    which was false.)"""
    model = zoo.as_published("Qwen/Qwen3.5-35B-A3B")
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    router = router_of(model, None)
    assert router.coef == model.config.text_config.router_aux_loss_coef > 0
    assert (router.num_experts, router.top_k) == (256, 8)
    batch = rollout(model.config.text_config.vocab_size, groups=2, size=2)
    expected = trl_aux_loss(model, batch)
    record = colograd_aux_loss(model, batch, padding_free=False)  # a hybrid's passes run padded
    assert (record.aux_loss - expected).abs() <= 1e-5 * expected, (record.aux_loss, expected)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, router_of(model, 0.0).router_class)]


def test_the_router_loss_has_a_gradient_into_the_routers():
    model = moe_model(MIXTRAL)
    model.train()
    record = RouterRecord(router_of(model, None))
    completion_logps(model, rollout(model.config.vocab_size), router=record)
    assert record.loss() == 0.02 * record.aux_loss  # the published config's coefficient
    record.loss().backward()
    assert routers(model) and all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in routers(model))


def test_the_expert_load_shows_a_collapsed_router():
    """Each layer's shares sum to the experts' count (mean 1); a router that sends every token to the same experts
    reads E / k for them and 0 for the rest."""
    model = moe_model(MIXTRAL)
    batch = rollout(model.config.vocab_size)
    record = colograd_aux_loss(model, batch)
    e, k = model.config.num_local_experts, model.config.num_experts_per_tok
    assert torch.allclose(record.load_LE.sum(1), torch.full((record.load_LE.size(0),), float(e)))
    healthy = record.metrics()
    assert 1 < healthy["moe/expert_load/max"] < e / k and healthy["aux_loss"] > 0
    with torch.no_grad():
        for m in routers(model):
            m.weight.zero_()  # equal logits for every expert: top-k takes the same k for every token
    collapsed = colograd_aux_loss(model, batch).metrics()
    assert collapsed["moe/expert_load/max"] == pytest.approx(e / k)
    assert collapsed["moe/expert_load/min"] == 0.0


def test_the_training_loss_adds_coef_times_the_router_loss(tmp_path):
    """`GRPOTrainer.compute_loss` on a slice: with the model's routers, the GRPO loss plus 0.02 (Mixtral's
    coefficient) × the router's loss, which is logged with the experts' load; without them, the GRPO loss alone."""
    from collections import defaultdict
    from types import MethodType, SimpleNamespace

    from colograd import GRPOTrainer
    from colograd.forward.core import Forward
    from colograd.grpo.entropy import EntropyTerms
    from colograd.grpo.parity import ParityGuard, tolerance
    from colograd.runs.timing import PhaseTimes

    model = moe_model(MIXTRAL).train()
    batch = rollout(model.config.vocab_size)
    n, t = batch["completion_ids"].shape
    inputs = {**batch, "advantages": torch.linspace(-1, 1, n), "engine_logps": torch.zeros(n, t),
              "tool_mask": torch.ones(n, t), "num_items": batch["completion_mask"].sum().float()}  # fmt: skip
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=n, num_generations=4)

    def trainer(router):
        metrics = defaultdict(list)
        fake = SimpleNamespace(
            args=args, forward=Forward(args, router=router), _micro_step=1, metrics=metrics, _times=PhaseTimes(),
            entropy=EntropyTerms(args, SimpleNamespace(sync_gradients=True), lambda x: x, metrics),
            parity=ParityGuard(tolerance(torch.float32, torch.float32), "Mixtral"),
        )  # fmt: skip
        for name in ("completion_logps", "_record"):
            setattr(fake, name, MethodType(getattr(GRPOTrainer, name), fake))
        return fake

    with_router = trainer(router_of(model, None))
    loss = GRPOTrainer.compute_loss(with_router, model, inputs)
    grpo_only = GRPOTrainer.compute_loss(trainer(None), model, inputs)
    aux = colograd_aux_loss(model, batch).aux_loss
    assert torch.allclose(loss - grpo_only, 0.02 * aux, rtol=1e-5), (loss - grpo_only, aux)
    assert with_router.metrics["aux_loss"] == [pytest.approx(aux.item(), rel=1e-5)]
    assert with_router.metrics["moe/expert_load/max"][0] >= 1


def test_a_moe_models_backward_is_the_same_twice_under_the_trainers_kernels():
    """Under `deterministic_kernels` a Qwen3-MoE (real vocabulary, 128 experts, top 8) gives the same gradients twice
    on one batch, to the bit (without them its experts' gather adds its gradients on several threads in whatever
    order: measured 19 of 25 tensors apart on 2 threads, so that a resumed run parts from an uninterrupted one), and
    the setting the caller had is back after. Tensors are not filled with NaN at birth meanwhile (the setting's
    debugging aid, which changes no result and cost 6% of a hybrid's training phase), and the caller's fill is back
    after too."""
    from colograd.forward.core import deterministic_kernels

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo.shrunk("Qwen/Qwen3-30B-A3B"), dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (8, 128))

    def gradients():
        model.zero_grad()
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with deterministic_kernels(torch.device("cpu")):
        first, second = gradients(), gradients()
    assert len(first) > 20 and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    for before, warn_only in ((False, False), (True, False), (True, True)):
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        try:
            with deterministic_kernels(torch.device("cpu")):
                assert torch.are_deterministic_algorithms_enabled()
                assert not torch.utils.deterministic.fill_uninitialized_memory
            assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default, as the caller had it
            assert torch.are_deterministic_algorithms_enabled() is before
            assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
        finally:
            torch.use_deterministic_algorithms(False)
