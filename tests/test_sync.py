"""The weight sync's own behaviour that needs no engine (its parity with the engine: tests/test_engine.py)."""

import logging

import pytest

import colograd.sync  # noqa: F401  (installs the log filters)


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
