"""Where one of vLLM's model classes computes another model than transformers' from the same weights, and the fix is
the engine's to make: each function here changes the class for engines built from now on in this process, and is
idempotent. The parity gate found each one (docs/real-models.md, "Families the tests never name").

vLLM internals relied on (vllm 0.32): `vllm.model_executor.models.gemma3n.Gemma3nForCausalLM.forward` and its text
model's `get_per_layer_input_embeddings`. Where a version no longer has a name, nothing is changed, and the gate still
judges the engine.
"""

from typing import Any

import torch


def add_gemma3n_per_layer_embeddings() -> bool:
    """Give vLLM's text-only Gemma-3n (`Gemma3nForCausalLM`) the per-layer token embeddings it drops.

    Gemma-3n adds to every layer's input a slice of a second embedding table (`embed_tokens_per_layer`, a
    vocabulary × layers × 256 table), looked up by token id, to a projection of the hidden state. vLLM 0.32 computes
    that lookup only in its vision-language class (`Gemma3nForConditionalGeneration` hands it in as
    `per_layer_inputs`); its text-only class is never handed it, and its decoder then takes `per_layer_inputs=None`
    for the start-up's profiling run, using the projection alone. A shrunk Gemma-3n sampled 0.06 nats from its
    trainer at the first rollout (every layer's per-layer input off by up to 1.3), and the gate stopped it. The text
    model's forward now looks the slices up from the token ids where none are handed in, as the vision-language
    class does.

    Returns:
        Whether the class now looks them up (False: a vLLM without this class or method, left as it is).
    """
    try:
        from vllm.model_executor.models.gemma3n import Gemma3nForCausalLM, Gemma3nTextModel
    except ImportError:
        return False
    forward = Gemma3nForCausalLM.__dict__.get("forward")
    if forward is None or not hasattr(Gemma3nTextModel, "get_per_layer_input_embeddings"):
        return False
    if getattr(forward, "per_layer_embeddings", False):
        return True

    def forward_with_per_layer_inputs(
        self: Any, input_ids: torch.Tensor | None, positions: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if kwargs.get("per_layer_inputs") is None and input_ids is not None:
            text = self.config
            looked_up = self.model.get_per_layer_input_embeddings(input_ids)
            kwargs["per_layer_inputs"] = looked_up.reshape(
                -1, text.num_hidden_layers, text.hidden_size_per_layer_input
            )
        return forward(self, input_ids, positions, *args, **kwargs)

    forward_with_per_layer_inputs.per_layer_embeddings = True
    forward_with_per_layer_inputs.__wrapped__ = forward
    Gemma3nForCausalLM.forward = forward_with_per_layer_inputs
    return True
