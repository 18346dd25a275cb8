"""Models whose layers carry state along the sequence (Qwen3.5's Gated DeltaNet linear attention): the trainer's
passes give each completion the state its own prompt left, never its neighbour's (`colograd.forward.core`).

transformers' torch path of these layers reads no sequence boundary: packed end to end in one row (padding-free),
or after a prompt shared by its group, a sequence starts from the state the one before it left. The trainer packs
them all the same and gives each layer with state its sequences apart (`colograd.forward.stateful`); padded rows are
exact too (left padding is masked to zeros before the layers, which leaves their state at zero). The model is
Qwen3.5-4B's text model shrunk in width only (tests/zoo.py: its real vocabulary, head layout and 3:1 pattern),
sharp weights.
"""

import pytest
import torch
import zoo
from transformers import AutoConfig, AutoModelForCausalLM

from colograd.config.core import GRPOConfig
from colograd.forward.core import Forward
from colograd.forward.logps import completion_logps
from colograd.models.hybrid import carries_state, state_layer_kinds

HYBRID = "Qwen/Qwen3.5-4B"
N, P, T = 6, 24, 40  # sequences, prompt and completion widths of the padded rollout


@pytest.fixture(scope="module")
def hybrid():
    """The shrunk Qwen3.5 (fp32, sharp weights) and its tokenizer."""
    config = zoo.shrunk(HYBRID)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    zoo.sharpen(model)
    return model, zoo.tokenizer_for(config)


def rollout(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout as `pad_rollout` lays it out: prompts left-padded, completions right-padded, lengths that vary;
    rows 0-2 share a prompt (a GRPO group), as do rows 3-4."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (N, P + T), generator=gen)
    mask = torch.zeros(N, P + T, dtype=torch.long)
    for i in range(N):
        prompt = int(torch.randint(P // 2, P + 1, (1,), generator=gen))
        completion = T if i == 0 else int(torch.randint(4, T + 1, (1,), generator=gen))
        mask[i, P - prompt : P + completion] = 1
    for source, copies in ((0, (1, 2)), (3, (4,))):
        for i in copies:
            ids[i, :P], mask[i, :P] = ids[source, :P], mask[source, :P]
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": ids[:, P:],
        "completion_mask": mask[:, P:],
    }


def alone(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's completion log-probs from a forward pass over that sequence alone: [N, T]."""
    out = torch.zeros(N, T)
    for i in range(N):
        kept = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][kept][None]
        with torch.no_grad():
            logps = model(ids, use_cache=False).logits[0].float().log_softmax(-1)
        prompt = int(batch["attention_mask"][i, :P].sum())
        length = int(batch["completion_mask"][i].sum())
        targets = batch["completion_ids"][i, :length]
        out[i, :length] = logps[prompt - 1 : prompt - 1 + length].gather(-1, targets[:, None])[:, 0]
    return out


def test_a_hybrids_passes_give_each_sequence_the_state_its_own_prompt_left(hybrid, tmp_path):
    """With padding_free on (the default), the run's passes over a hybrid are packed, each layer with state given
    its sequences apart (`colograd.forward.stateful`), and equal those of each sequence alone. Packed without that, the
    same model gives other log-probs to the sequences that follow another in a row, and so does a prompt shared by
    its group: that is the leak the layout keeps out (the check has power)."""
    model, tokenizer = hybrid
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    assert args.padding_free
    forward = Forward.of([model], args, tokenizer)
    assert forward.packed and forward.prompt_cost is None and forward.segments is None
    assert len(forward.apart.layers) == 3  # the three Gated DeltaNet layers of the shrunk model's four
    batch = rollout()
    mask = batch["completion_mask"].bool()
    expected = alone(model, batch)
    with torch.no_grad():
        got = forward.logps(model, batch)
        rows = completion_logps(model, batch, padding_free=True, row_tokens=90, apart=forward.apart)  # 2+ rows
        packed = completion_logps(model, batch, padding_free=True)
        shared = completion_logps(model, batch, padding_free=True, share_prompts=0.1)
    assert (got - expected)[mask].abs().max() < 1e-4
    assert (rows - expected)[mask].abs().max() < 1e-4
    assert (packed - expected)[mask].abs().max() > 1e-2
    assert (shared - expected)[mask].abs().max() > 1e-2


def test_sequences_are_grouped_by_length_where_that_cuts_the_padding_enough():
    """Hand-worked: 16 sequences of 18-92 tokens padded to 92 are 1,472 tokens; split after the 9 shortest (to 54)
    they are 9 × 54 + 7 × 92 = 1,130 (23% fewer), and no further split saves 15% of that. Equal lengths stay one
    group; two sequences 10 and 200 long are two."""
    from colograd.forward.stateful import groups

    lengths = [87, 18, 54, 19, 92, 21, 35, 39, 40, 72, 47, 52, 67, 68, 71, 87]
    found = groups(lengths)
    assert [sorted(lengths[i] for i in group) for group in found] == [
        [18, 19, 21, 35, 39, 40, 47, 52, 54],
        [67, 68, 71, 72, 87, 87, 92],
    ]
    assert sorted(i for group in found for i in group) == list(range(16))
    assert groups([50] * 16) == [list(range(16))]
    assert groups([10, 200]) == [[0], [1]]
    assert len(groups(list(range(1, 4000, 3)))) == 2  # evenly spread: halved once (25%), not again (12.5%)
    # A layer that pads every sequence to its chunk of 256 tokens (Mamba-2's torch path) computes these as one.
    assert len(groups(lengths, multiple=256)) == 1
    assert [len(g) for g in groups([100, 100, 300, 300], multiple=256)] == [2, 2]  # 2 × 256 + 2 × 512 < 4 × 512


def test_a_layer_with_state_computes_each_group_padded_to_its_own_longest(hybrid, tmp_path):
    """The rollout's sequences (16 to 64 tokens) reach each layer with state as two groups, each padded to its own
    longest, together every sequence once; the log-probs are each sequence's alone (the test above) either way."""
    from colograd.forward.stateful import groups

    model, tokenizer = hybrid
    forward = Forward.of([model], GRPOConfig(output_dir=str(tmp_path), report_to="none"), tokenizer)
    batch = rollout()
    lengths = batch["attention_mask"].sum(1).tolist()
    expected = sorted((len(group), max(lengths[i] for i in group)) for group in groups(lengths))
    assert len(expected) == 2
    layer = forward.apart.layers[0]
    first = next(child for child in layer.children() if isinstance(child, torch.nn.Linear))
    seen = []
    handle = first.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape[:2])))
    try:
        with torch.no_grad():
            got = forward.logps(model, batch)
    finally:
        handle.remove()
    assert sorted(seen) == expected
    mask = batch["completion_mask"].bool()
    assert (got - alone(model, batch))[mask].abs().max() < 1e-4


def test_a_hybrids_packed_gradient_is_the_padded_one_under_gradient_checkpointing(tmp_path):
    """A layer recomputed in the backward lays out its input as its forward did (the layout travels with the
    model's call): the packed pass's gradient, checkpointed, is the padded pass's."""
    config = zoo.shrunk(HYBRID)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    zoo.sharpen(model)
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    forward = Forward.of([model], args, zoo.tokenizer_for(config))
    batch = rollout()
    mask = batch["completion_mask"].bool()

    def gradient(checkpointed: bool, **kwargs) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        completion_logps(model, batch, **kwargs)[mask].sum().backward()
        model.gradient_checkpointing_disable()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    padded = gradient(False, padding_free=False)
    packed = gradient(True, padding_free=True, row_tokens=90, apart=forward.apart)
    leaked = gradient(True, padding_free=True, row_tokens=90)  # packed, the layers with state not told
    assert packed.keys() == padded.keys() and any("conv1d" in name for name in packed)
    for name, grad in padded.items():
        assert (packed[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
    assert max(((leaked[n] - g).abs().max() / g.abs().max()).item() for n, g in padded.items()) > 1e-2


@pytest.mark.slow  # a process of its own each (gloo and DeepSpeed's partitioning): 10-12 s
@pytest.mark.parametrize(
    "name, expected",
    [
        (HYBRID, {"apart": True, "layers": 3}),
        # An attention model whose mask ignores the position ids: its packed passes must be found to leak there too.
        ("openai/gpt-oss-20b", {"apart": False, "layers": 0}),
    ],
)
def test_the_packing_probe_runs_on_weights_zero3_partitioned(name, expected):
    """Under ZeRO-3 the model's weights are partitioned before DeepSpeed's engine (whose hooks gather them) runs it:
    the start-up probe gathers a layer at a time (`gathered_in_forward`), so a hybrid's passes run packed there too,
    and the probe computes with the real weights: the plain packed forward is seen to leak, the hybrid's state and
    gpt-oss's attention alike (gpt-oss trained packed under ZeRO-3 before, its sequences attending to each other).
    Without the gathering the probe's forward fails and sees nothing (checked by hand: apart false, no leak seen).
    After the probe every weight is partitioned again."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, "tests/scripts/zero3_probe.py", name], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record == {"partitioned": True, **expected, "plain_packing_leaks": True, "partitioned_after": True}


def test_a_hybrid_whose_layers_with_state_are_not_all_found_trains_padded(hybrid, tmp_path):
    """The hooks must reach every layer the config lists with state: a config that lists one more (a layer kind the
    search does not find) trains padded, as before; a pass in which a layer with state did not take the layout
    stops in one line."""
    from colograd.forward.core import packed_apart
    from colograd.forward.stateful import Apart

    model, tokenizer = hybrid
    text = model.config.get_text_config()
    kinds = list(text.layer_types)
    try:
        text.layer_types = ["linear_attention"] * len(kinds)
        assert packed_apart([model], model) is None
    finally:
        text.layer_types = kinds
    apart = Apart(model)
    try:
        with pytest.raises(RuntimeError, match="3 of the model's 3 layers with state were called without"):
            with apart.counted(), torch.no_grad():
                model(rollout()["input_ids"][:1], use_cache=False)
    finally:
        apart.remove()


def test_an_all_attention_model_still_packs_unless_its_engine_holds_state(tmp_path):
    """The padded layout is for layers with state only: an attention model's passes stay padding-free. Where the
    engine's cache holds state pages (`Engine.holds_state`) for a model whose config lists no such layers (a config
    spelling nobody here reads), the passes run padded all the same."""
    config = zoo.shrunk("Qwen/Qwen3-0.6B")
    model = AutoModelForCausalLM.from_config(config)
    args, tokenizer = GRPOConfig(output_dir=str(tmp_path), report_to="none"), zoo.tokenizer_for(config)
    assert Forward.of([model], args, tokenizer).packed and not carries_state(model.config)
    assert not Forward.of([model], args, tokenizer, engine_state=True).packed


def test_a_model_whose_mask_ignores_the_position_ids_trains_padded(tmp_path):
    """gpt-oss (transformers 5.19) builds its attention mask without the position ids, so sequences packed in one row
    without a mask attend to each other: in a padding-free pass of the zoo's gpt-oss, the second sequence of a
    packed row was 3.2 nats off its padded log-probs. The probe finds it (and no such thing in Qwen3), and the
    trainer's passes then run padded, which give each sequence its own log-probs."""
    from colograd.forward.logps import completion_logps
    from colograd.forward.packing import keeps_packed_sequences_apart

    config = zoo.shrunk("openai/gpt-oss-20b")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    zoo.sharpen(model)
    qwen = AutoModelForCausalLM.from_config(zoo.shrunk("Qwen/Qwen3-0.6B")).eval()
    assert not keeps_packed_sequences_apart(model) and keeps_packed_sequences_apart(qwen)
    args, tokenizer = GRPOConfig(output_dir=str(tmp_path), report_to="none"), zoo.tokenizer_for(config)
    assert not Forward.of([model], args, tokenizer).packed
    # Two sequences that share a packed row: packed without a mask, the second is off; padded, both are exact.
    batch = {"input_ids": torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1))}
    batch["attention_mask"] = torch.ones(2, 24, dtype=torch.long)
    batch["attention_mask"][1, :6] = 0
    batch["input_ids"] *= batch["attention_mask"]
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    batch["completion_ids"], batch["completion_mask"] = batch["input_ids"][:, 12:], batch["attention_mask"][:, 12:]
    with torch.no_grad():
        packed = completion_logps(model, batch, padding_free=True, row_tokens=48)
        padded = completion_logps(model, batch, padding_free=False)
        alone = [
            completion_logps(model, {k: v[i : i + 1] for k, v in batch.items()}, padding_free=False) for i in (0, 1)
        ]
    assert (padded - torch.cat(alone)).abs().max() < 1e-4
    assert (packed - padded).abs().max() > 1e-2


@pytest.mark.parametrize(
    "model_type, values, kinds",
    [
        ("qwen3_5_text", {}, ["linear_attention"]),
        ("qwen3_next", {}, ["linear_attention"]),
        ("falcon_h1", {}, ["hybrid"]),  # every layer attention and Mamba-2 side by side
        # transformers spells Granite 4's "mamba" layers "linear_attention"
        (
            "granitemoehybrid",
            {"layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3},
            ["linear_attention"],
        ),
        ("lfm2", {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}, ["conv"]),
        ("nemotron_h", {}, ["linear_attention"]),  # its MLP and MoE layers are no state
        ("jamba", {}, ["mamba", "linear_attention"]),  # its two lists, each in its own words
        ("minimax", {}, ["linear_attention"]),
        ("mamba2", {}, ["linear_attention"]),
        ("mamba", {}, ["linear_attention"]),
        ("llama", {}, []),
        ("gemma3_text", {}, []),  # sliding-window attention
    ],
)
def test_the_layers_that_carry_state_are_read_from_the_config(model_type, values, kinds):
    """The published configs' ways of listing layer kinds, as vLLM reads them."""
    text = AutoConfig.for_model(model_type, **values).get_text_config()
    assert state_layer_kinds(text) == kinds


def test_mamba2_layers_bound_their_time_step_by_the_configs_limit_as_the_engine_does(tmp_path, caplog):
    """vLLM's Mamba-2 layers bound the time step to (0, inf); transformers' Nemotron-H bounds it below by its
    config's time_step_min (an initialisation range). The trainer's passes take the config's limit, said once; the
    families whose layers already read it are left alone. The bound matters: a time step under 0.001 (a dt_bias
    of -9) changes the log-probs."""
    from colograd.models.hybrid import bound_time_steps_as_configured

    config = zoo.shrunk("nvidia/Nemotron-H-8B-Base-8K")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    zoo.sharpen(model)
    mixers = [m for m in model.modules() if "time_step_limit" in m.__dict__]
    assert len(mixers) == 4 and all(m.time_step_limit == (0.001, float("inf")) for m in mixers)
    with torch.no_grad():
        mixers[0].dt_bias.fill_(-9.0)
        ids = torch.randint(3, 60, (1, 24), generator=torch.Generator().manual_seed(0))
        before = model(ids).logits
    with caplog.at_level("WARNING"):
        Forward.of([model], GRPOConfig(output_dir=str(tmp_path), report_to="none"), zoo.tokenizer_for(config),
                   announce=True)  # fmt: skip
    assert all(m.time_step_limit == (0.0, float("inf")) for m in mixers)
    assert "4 Mamba-2 layers bound their time step by (0.0, inf), as the engine's do" in caplog.text
    with torch.no_grad():
        assert (model(ids).logits - before).abs().max() > 1e-3
    assert bound_time_steps_as_configured(model)[0] == 0  # once
    for name in ("ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-0.5B-Instruct"):  # their layers read the limit
        assert bound_time_steps_as_configured(AutoModelForCausalLM.from_config(zoo.shrunk(name)))[0] == 0
    # Zamba2's config sets no limit (its layers bound by time_step_min too): they get the engine's
    zamba2 = AutoConfig.for_model("zamba2", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  n_mamba_heads=4, layers_block_type=["linear_attention", "hybrid"])  # fmt: skip
    assert not hasattr(zamba2, "time_step_limit")
    model = AutoModelForCausalLM.from_config(zamba2)
    assert bound_time_steps_as_configured(model) == (2, (0.001, float("inf")), (0.0, float("inf")))


def vllm_gated_norm(norm, groups: int, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """vLLM's gated norm of a Mamba-2 layer (`Mixer2RMSNormGated.forward_native`, one tensor-parallel rank) of
    `norm`'s weight in `groups` groups: a stand-in for the layer that holds what its `__init__` sets."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import Mixer2RMSNormGated

    width = norm.weight.numel()
    layer = Mixer2RMSNormGated.__new__(Mixer2RMSNormGated)
    torch.nn.Module.__init__(layer)
    layer.__dict__ |= {"tp_size": 1, "tp_rank": 0, "full_hidden_size": width, "group_size": width // groups,
                       "per_rank_hidden_size": width, "n_groups": groups, "variance_epsilon": norm.variance_epsilon,
                       "use_rms_norm": True}  # fmt: skip
    layer.weight = torch.nn.Parameter(norm.weight.detach().clone())
    return layer.forward_native(x, gate)


def codestral() -> tuple:
    """Mamba-Codestral-7B shrunk (8 groups), sharp weights, in evaluation mode: its config, model and the gated norms
    of its Mamba-2 layers."""
    config = zoo.shrunk("mistralai/Mamba-Codestral-7B-v0.1")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    zoo.sharpen(model)
    return config, model, [m.norm for m in model.modules() if hasattr(m, "n_groups") and hasattr(m, "norm")]


def test_mamba2_layers_normalize_their_output_by_group_as_the_engine_does(tmp_path, caplog):
    """A Mamba-2 layer's gated norm takes its statistics over each group of channels in vLLM (and in the reference
    layer); transformers' torch path of Mamba-2 takes them over the whole width. Mamba-Codestral's 8 groups: the
    trainer's norm is vLLM's after `Forward.of`, said once; a norm of one group, or one that reads its groups, is
    left alone."""
    from colograd.models.hybrid import normalize_groups_as_configured

    config, model, norms = codestral()
    assert len(norms) == 2 and config.n_groups == 8
    gen = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(2, 5, norms[0].weight.numel(), generator=gen) * torch.linspace(0.1, 4, 512) for _ in "xg")
    engine = vllm_gated_norm(norms[0], 8, x, gate)
    with torch.no_grad():
        assert (norms[0](x, gate) - engine).abs().max() > 1e-2  # the whole width's statistics
        ids = torch.randint(3, 60, (1, 24), generator=gen)
        before = model(ids).logits
    with caplog.at_level("WARNING"):
        Forward.of([model], GRPOConfig(output_dir=str(tmp_path), report_to="none"), zoo.tokenizer_for(config),
                   announce=True)  # fmt: skip
    assert "2 Mamba-2 layers normalize their output in groups of channels (n_groups)" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(norms[0](x, gate), engine, rtol=1e-6, atol=1e-6)
        assert (model(ids).logits - before).abs().max() > 1e-3
    assert normalize_groups_as_configured(model) == 0  # once
    one_group = zoo.shrunk("mistralai/Mamba-Codestral-7B-v0.1")
    one_group.n_groups = 1
    for other in (one_group, zoo.shrunk("tiiuae/Falcon-H1-0.5B-Instruct"), zoo.shrunk("nvidia/Nemotron-H-8B-Base-8K")):
        assert normalize_groups_as_configured(AutoModelForCausalLM.from_config(other)) == 0, other.model_type


def test_a_gated_norm_under_accelerate_hooks_is_grouped_inside_its_hook():
    """A model dispatched with a device map carries accelerate's hooks: the norm's instance `forward` runs the hook
    around `_old_forward`. The grouped norm goes there, so the hook still runs and the norm computes vLLM's; once."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from colograd.models.hybrid import normalize_groups_as_configured

    class Counted(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counted.calls += 1
            return args, kwargs

    _, model, norms = codestral()
    for norm in norms:
        add_hook_to_module(norm, Counted())
    assert normalize_groups_as_configured(model) == len(norms) == 2
    gen = torch.Generator().manual_seed(1)
    x, gate = (torch.randn(2, 5, norms[0].weight.numel(), generator=gen) * torch.linspace(0.1, 4, 512) for _ in "xg")
    with torch.no_grad():
        torch.testing.assert_close(norms[0](x, gate), vllm_gated_norm(norms[0], 8, x, gate), rtol=1e-6, atol=1e-6)
    assert Counted.calls == 1
    assert normalize_groups_as_configured(model) == 0


def test_the_multiple_a_layer_pads_to_is_its_chunk_where_it_has_one(hybrid):
    """Mamba-2 layers pad each sequence to their config's chunk (128 or 256 in the published configs), which the
    grouping counts; Gated DeltaNet's layer has no such attribute (its chunks of 64 are the kernel's default): 1."""
    from colograd.forward.stateful import mixers, padded_to

    for name in ("nvidia/Nemotron-H-8B-Base-8K", "ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-0.5B-Instruct"):
        config = zoo.shrunk(name)
        chunk = getattr(config, "chunk_size", None) or config.mamba_chunk_size
        layers = mixers(AutoModelForCausalLM.from_config(config))
        assert chunk in (128, 256) and layers and {padded_to(m) for m in layers} == {chunk}
    assert {padded_to(m) for m in mixers(hybrid[0])} == {1}


def test_a_model_whose_layers_are_in_no_layer_list_is_not_gathered_whole_under_zero3():
    """The ZeRO-3 probe gathers a layer list's layers one at a time and the rest for the probe: a model with no
    `nn.ModuleList` would be gathered whole on every rank, so it is not probed (the probe's fallback: padded passes,
    exact). Partitioned weights stood in for (DeepSpeed's `ds_id`, `ds_numel`,
    an empty tensor)."""
    from torch import nn

    from colograd.forward.packing import gathered_in_forward

    def partitioned(module: nn.Module) -> nn.Module:
        for name, p in list(module.named_parameters()):
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            empty = nn.Parameter(torch.empty(0))
            empty.ds_id, empty.ds_numel = id(p), p.numel()
            setattr(owner, name.rpartition(".")[2], empty)
        return module

    flat = partitioned(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)))
    with pytest.raises(RuntimeError, match="has no layer list"):
        with gathered_in_forward(flat):
            pass
