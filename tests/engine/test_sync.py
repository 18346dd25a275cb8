"""The weight sync's own behaviour that needs no engine (its parity with the engine: tests/engine/test_engine.py)."""

import logging

import pytest

import colograd.engine.sync  # noqa: F401  (installs the log filters)


@pytest.mark.parametrize(
    "logger, message",
    [
        ("vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights: model.layers.3.mlp"),
        ("vllm.model_executor.model_loader.reload.inplace", "Following weights were not loaded from checkpoint: {}"),
        ("vllm.v1.worker.gpu_model_runner", "Following weights were not loaded from checkpoint: {'lm_head.weight'}"),
    ],
)
def test_partial_reload_warnings_of_each_vllm_release_are_quiet_and_others_are_not(logger, message, caplog):
    with caplog.at_level(logging.WARNING, logger=logger):
        logging.getLogger(logger).warning(message)
        logging.getLogger(logger).warning("CUDA graph capture failed")
    assert [r.getMessage() for r in caplog.records] == ["CUDA graph capture failed"]


class RecordingEngine:
    """Stands in for `colograd.engine.core.Engine` in a sync: records what reaches it; a level-2 sleep drops
    weights."""

    def __init__(self) -> None:
        self.stale, self.calls = True, []

    def load_weights(self, weights) -> None:
        self.calls.append("base")
        self.stale = False

    def load_adapter(self, tensors, config) -> None:
        self.calls.append("adapter")


def test_adapter_only_sync_sends_the_base_again_after_the_engine_dropped_it():
    """An adapter-only sync sends the frozen base once, then the adapter alone, unless the engine dropped its
    weights (a level-2 sleep marks it stale): then the base goes again, or the adapter would sit on no base."""
    from peft import LoraConfig, get_peft_model

    from colograd.engine.sync import WeightPlan
    from colograd.models import tiny

    model = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    plan, engine = WeightPlan(model, adapter_only=True), RecordingEngine()
    plan.sync(engine)
    plan.sync(engine)
    engine.stale = True  # asleep at level 2 and woken: the weights memory came back empty
    plan.sync(engine)
    assert engine.calls == ["base", "adapter", "adapter", "base", "adapter"]
