"""Agentic GRPO on 2 processes with the real engine: tools (one that raises, one that times out) and an
environment. See tests/scripts/agents_run.py for what each run does."""

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.slow  # one multi-process launch with engines, shared by every test


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("agents")
    proc = launch("tests/scripts/agents_run.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def steps(run):
    return [h for h in run["log_history"] if "loss" in h]


def rollouts(run):
    """The logged steps that made a rollout (with two updates per rollout, every other one)."""
    return [h for h in steps(run) if "tools/call_frequency" in h]


def test_tools_run_fail_and_time_out_without_stopping_training(runs):
    for rank in runs:
        assert len(steps(rank)) == 3 and len(rollouts(rank)) == 2
        assert rank["calls"]["count"] > 0 and rank["calls"]["flaky"] > 0 and rank["calls"]["slow"] > 0
        for h in rollouts(rank):
            assert h["tools/call_frequency"] > 0 and 0 < h["tools/failure_frequency"] < 1
            assert h["tools/turns/mean"] > 1 and h["tools/turns/max"] >= 2


def test_tool_results_are_read_but_never_trained_on(runs):
    for rank in runs:
        assert len(rank["masks"]) == 2
        assert all(m["inserted"] > 0 for m in rank["masks"])
        assert all(m["inserted_in_loss"] == 0 for m in rank["masks"])


def test_engine_and_trainer_agree_on_the_model_tokens_across_turns(runs):
    # The sampling gap and the importance-sampling ratio are taken over sampled tokens only: an inserted token's
    # 0.0 stand-in log-prob would show as a gap of several nats and a clipped ratio.
    for rank in runs:
        gaps = [h["sampling/sampling_logp_difference/max"] for h in rollouts(rank)]
        assert len(gaps) == 2 and max(gaps) < 1e-3
        for h in steps(rank):
            assert (
                0.99
                < h["sampling/importance_sampling_ratio/min"]
                <= h["sampling/importance_sampling_ratio/max"]
                < 1.01
            )


def test_environment_per_completion_adds_to_the_prompt_and_rewards(runs):
    for rank in runs:
        assert rank["environments"] == rank["distinct_environments"] == 64  # 8 prompts × 8 completions per rank
        assert rank["prompt_ends_with_observation"] and rank["env_calls"] > 0
        for h in rollouts(rank):
            assert "rewards/Counter/mean" in h and h["rewards/Counter/mean"] > 0
