"""What the per-token entropies cost the training forward + backward (`colograd.forward.logps`).

On a model with SmolLM2-135M's shape (Llama, hidden 576, vocabulary 49,152, tied embeddings; random weights,
fp32; `layers` of its 30 layers, so that the output layer's share is at least the real model's), one process:
`completion_logps` forward and backward over a batch of completions, without entropies (what a run without any
entropy option would need), with them detached (the `entropy` metric and `top_entropy_quantile`, what colograd
computes at every step) and with their gradient (the entropy bonus). Medians of `repeats` timed runs after a
warm-up, and each mode's time as a ratio to the first.
"""

import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout
from colograd.forward.logps import completion_logps

MODES = {"none": None, "detached": "detached", "grad": "grad"}


def build_model(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def run(layers: int = 6, completions: int = 16, length: int = 128, repeats: int = 3, as_json: bool = False) -> dict:
    model = build_model(layers)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 49152, (length,), generator=gen).tolist() for _ in range(completions)]
    rollout = Rollout(completion_ids=ids, logps=[[0.0] * length] * completions, truncated=[False] * completions)
    batch = pad_rollout([list(range(10, 42))] * completions, rollout, torch.zeros(completions), 1, pad_token_id=0)

    def step(entropy: str | None) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = completion_logps(model, batch, entropy=entropy)
        loss = out[0].sum() - 0.01 * out[1].sum() if entropy == "grad" else (out if entropy is None else out[0]).sum()
        loss.backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in MODES}
    for mode in MODES.values():
        step(mode)  # warm-up
    for _ in range(repeats):
        for name, mode in MODES.items():  # interleaved, so that load from other work falls on every mode alike
            times[name].append(step(mode))
    medians = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "tokens": completions * length,
        "layers": layers,
        **{f"{name}_s": round(s, 3) for name, s in medians.items()},
        **{f"{name}_ratio": round(s / medians["none"], 3) for name, s in medians.items()},
    }
    if as_json:
        print(json.dumps(report))
    else:
        print(f"completion_logps forward + backward, {report['tokens']} completion tokens, {layers} layers:")
        for name in MODES:
            print(f"  entropy {name:9s} {report[name + '_s']:7.3f} s   × {report[name + '_ratio']:.3f}")
    return report
