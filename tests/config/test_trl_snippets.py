"""TRL 1.16's documented GRPO snippets, run with only the import changed (`from colograd import ...`).

Each test is one snippet of TRL's docs (the section is named in its docstring), as written there, except for what a
machine without network or GPU needs: a local tiny model folder for the hub model (with the 32,768-token context of
TRL's own tiny test models, as a user's Qwen has), a few in-memory rows for the hub dataset,
and, to keep each run short, `max_steps=2` (and often `max_completion_length=64`) where the snippet has a config.
Every run is real: the engine samples, the rewards score, the optimizer steps.
"""

import asyncio
import math
import random
import re

import pytest
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM, TrainerCallback

from colograd import GRPOConfig, GRPOTrainer
from colograd.models import tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """Stands in for a hub id: the tiny model and tokenizer, saved, with a real model's 32,768-token context."""
    folder = tmp_path_factory.mktemp("tiny-model")
    config = tiny.build_model().config
    config.max_position_embeddings = 32768
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Snippets without `output_dir` write to `<model name>-GRPO` in the working directory, as TRL's do."""
    monkeypatch.chdir(tmp_path)


def trained(trainer: GRPOTrainer, steps: int) -> list[dict]:
    """Train, check the run took `steps` optimizer steps, and return the metrics of each step that sampled."""
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == steps and logs
    return logs


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- "Quick start" ------------------------------------------------------------------------------------------------


def test_quick_start(model_folder):
    """grpo_trainer.md, Quick start: a hub model by name, TRL's accuracy reward, no config at all."""
    from trl.rewards import accuracy_reward

    # load_dataset("trl-lib/DeepMath-103K", split="train"): conversational prompts and a "solution" column.
    dataset = Dataset.from_list([{"prompt": chat("What is 2+2?"), "solution": "4"}])

    trainer = GRPOTrainer(
        model=model_folder,
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    # TRL's defaults: 8 completions per prompt, one prompt per step, three epochs of the one row.
    logs = trained(trainer, 3)
    assert trainer.args.output_dir.endswith("-GRPO") and "rewards/accuracy_reward/mean" in logs[0]


# --- "Using a custom reward function" -----------------------------------------------------------------------------


def test_several_reward_functions_sync_and_async(model_folder):
    """grpo_trainer.md, Examples 1, 1.1 and 5, passed together as "Passing the reward function to the trainer"
    shows, weighted with `reward_weights`."""

    def reward_func(completion_ids, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    def reward_len_chars(completions, **kwargs):  # Example 1.1's reward_func
        """Reward function that assigns higher scores to longer completions (in terms of character count)."""
        return [float(len(completion)) for completion in completions]

    async def async_reward_func(prompts, completions, **kwargs):
        # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
        await asyncio.sleep(0.01)
        # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
        return [1.0 if completion else 0.0 for completion in completions]

    dataset = Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}])
    trainer = GRPOTrainer(
        model=model_folder,
        reward_funcs=[reward_func, reward_len_chars, async_reward_func],
        args=GRPOConfig(max_steps=2, max_completion_length=64, reward_weights=[1.0, 0.0, 2.0]),
        train_dataset=dataset,
    )
    logs = trained(trainer, 2)
    for step in logs:
        means = [step[f"rewards/{name}/mean"] for name in ("reward_func", "reward_len_chars", "async_reward_func")]
        assert step["reward"] == pytest.approx(means[0] + 2 * means[2], rel=1e-5) and means[2] > 0


def test_reward_from_an_extra_column(model_folder):
    """grpo_trainer.md, Example 3: the dataset's `ground_truth` column reaches the reward function."""

    def reward_func(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]  # noqa: B905 (the docs' text)

    dataset = Dataset.from_list(
        [
            {"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "ground_truth": "2"},
            {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "ground_truth": "5"},
        ]
    )
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_func,
                          args=GRPOConfig(max_steps=2, max_completion_length=64), train_dataset=dataset)  # fmt: skip
    assert all(step["rewards/reward_func/mean"] == 0.0 for step in trained(trainer, 2))  # random text: no \boxed{}


def test_conversational_format_reward(model_folder):
    """grpo_trainer.md, Example 2: conversational prompts; the completions reach the reward as messages."""
    seen = []

    def format_reward_func(completions, **kwargs):
        """Reward function that checks if the completion has a specific format."""
        seen.extend(completions)
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        matches = [re.match(pattern, content) for content in completion_contents]
        return [1.0 if match else 0.0 for match in matches]

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}]},
            {"prompt": [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}]},
        ]
    )
    trainer = GRPOTrainer(model=model_folder, reward_funcs=format_reward_func, args=GRPOConfig(max_steps=2),
                          train_dataset=dataset)  # fmt: skip
    trained(trainer, 2)
    assert seen and all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen)


def test_multi_task_rewards_with_none(model_folder):
    """grpo_trainer.md, Example 4: task-specific rewards that return None for the other task's rows."""

    def check_math_solution(prompt, completion):  # the docs leave these to the reader
        return completion.strip().startswith(str(eval(prompt.removeprefix("What is ").removesuffix("?"))))

    def test_code_solution(prompt, completion):
        return "def " in completion

    # Define a dataset that contains both math and coding problems
    dataset = Dataset.from_list(
        [
            {"prompt": "What is 2+2?", "task": "math"},
            {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
            {"prompt": "What is 3*4?", "task": "math"},
            {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
        ]
    )

    # Math-specific reward function
    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):  # noqa: B905 (the docs' text)
            if t == "math":
                # Calculate math-specific reward
                correct = check_math_solution(prompt, completion)
                reward = 1.0 if correct else -1.0
                rewards.append(reward)
            else:
                # Return None for non-math tasks
                rewards.append(None)
        return rewards

    # Coding-specific reward function
    def coding_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):  # noqa: B905 (the docs' text)
            if t == "coding":
                # Calculate coding-specific reward
                works = test_code_solution(prompt, completion)
                reward = 1.0 if works else -1.0
                rewards.append(reward)
            else:
                # Return None for non-coding tasks
                rewards.append(None)
        return rewards

    # Use both task-specific reward functions
    trainer = GRPOTrainer(
        model=model_folder,
        reward_funcs=[math_reward_func, coding_reward_func],
        args=GRPOConfig(max_steps=2, max_completion_length=64, per_device_train_batch_size=32),  # every row, each step
        train_dataset=dataset,
    )
    logs = trained(trainer, 2)
    # Math rows are scored; the docs' coding reward checks for "coding" where the rows say "code": all None, so it
    # has no mean, and the math reward alone makes the total.
    for step in logs:
        assert -1.0 <= step["rewards/math_reward_func/mean"] <= 1.0
        assert math.isnan(step["rewards/coding_reward_func/mean"])


# --- "Agent Training" ---------------------------------------------------------------------------------------------


def test_tools(model_folder):
    """grpo_trainer.md, Tools: a sync and an async tool, described by their type hints and docstrings."""

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    async def async_add(a: int, b: int) -> int:
        """
        Asynchronously adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of the two integers.
        """
        return a + b

    def reward_func(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    dataset = Dataset.from_list([{"prompt": chat("What is 6 times 7?")}, {"prompt": chat("What is 2 plus 3?")}])
    trainer = GRPOTrainer(
        model=model_folder,
        reward_funcs=reward_func,
        args=GRPOConfig(max_steps=2, max_completion_length=64),
        train_dataset=dataset,
        tools=[multiply, async_add],
    )
    logs = trained(trainer, 2)
    assert [s["function"]["name"] for s in trainer.agents.schemas] == ["multiply", "async_add"]
    assert all("tools/call_frequency" in step for step in logs)


class IncrementEnv:
    """grpo_trainer.md, Environments: the environment owns the data and its reward."""

    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_environment_owns_the_data_and_the_reward(model_folder):
    """grpo_trainer.md, Environments: no train_dataset and no reward_funcs; reset() gives each prompt."""
    environments = []

    class Seeing(GRPOTrainer):  # the rollout's environments, as the rewards get them
        def generate(self, prompt_ids, context, images=None):
            rollout = super().generate(prompt_ids, context, images)
            environments[:] = rollout.columns["environments"]
            return rollout

    trainer = Seeing(
        model=model_folder,
        args=GRPOConfig(max_steps=2, chat_template_kwargs={"enable_thinking": False}, max_completion_length=64),
        environment_factory=IncrementEnv,
    )
    logs = trained(trainer, 2)
    assert all("rewards/IncrementEnv/mean" in step for step in logs)
    envs = environments
    assert len(envs) == 8 and all(isinstance(e, IncrementEnv) and 1 <= e.target <= 6 for e in envs)


def test_rollout_func_generates_with_the_trainers_engine(model_folder):
    """grpo_trainer.md, rollout_func: it replaces generation, generates with `trainer.vllm_generation` (TRL's
    colocate handle), and its extra keys reach the reward functions."""

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=trainer.args.num_generations
        )
        # An environment would score the completions here; a stand-in scores their length.
        env_rewards = [len(ids) / 10 for ids in completion_ids]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[lp[0] for lp in seq] for seq in logprobs],
            "env_reward": env_rewards,
        }

    def reward_from_env(completions, **kwargs):
        env_rewards = kwargs.get("env_reward", [])
        return [float(r) for r in env_rewards] if env_rewards else [0.0] * len(completions)

    dataset = Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}])
    trainer = GRPOTrainer(
        model=model_folder,
        reward_funcs=reward_from_env,
        args=GRPOConfig(max_steps=2, max_completion_length=32),
        train_dataset=dataset,
        rollout_func=rollout_func,
    )
    for step in trained(trainer, 2):
        assert step["rewards/reward_from_env/mean"] == pytest.approx(step["completions/mean_length"] / 10)


# --- the Trainer's own parameters ---------------------------------------------------------------------------------


def test_callbacks_in_trls_positional_order(model_folder):
    """transformers' callbacks, passed positionally in TRL's order (..., processing_class,
    reward_processing_classes, callbacks)."""

    class RewardLogger(TrainerCallback):
        def __init__(self):
            self.rewards = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    logger = RewardLogger()
    dataset = Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}])
    trainer = GRPOTrainer(model_folder, reward_len, GRPOConfig(max_steps=2), dataset, None, None, None, [logger])
    assert [step["reward"] for step in trained(trainer, 2)] == logger.rewards


def test_lora_through_peft_config(model_folder):
    """peft_integration.md, GRPO, Python Example: the trainer wraps the model with the adapter."""
    from peft import LoraConfig, PeftModel

    dataset = Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}])

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    # Configure LoRA
    peft_config = LoraConfig(
        r=32,
        lora_alpha=16,
        lora_dropout=0.05,
        bias="none",
        task_type="CAUSAL_LM",
    )

    # Configure training with higher learning rate for LoRA
    training_args = GRPOConfig(
        learning_rate=1.0e-5,  # 10x the base rate for GRPO with LoRA
        max_steps=2,
    )

    # Create trainer with PEFT config
    trainer = GRPOTrainer(
        model=model_folder,  # can pass model name or loaded model
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
        peft_config=peft_config,  # pass PEFT config here
    )
    trained(trainer, 2)
    assert isinstance(trainer.accelerator.unwrap_model(trainer.model), PeftModel)


def test_gspo_configuration(model_folder):
    """paper_index.md, GSPO: sequence-level importance sampling, a rollout partitioned into 4 mini-batches."""

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = GRPOConfig(
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,  # GSPO set KL regularization to zero
        epsilon=3e-4,  # GSPO paper (v2), section 5.1
        epsilon_high=4e-4,  # GSPO paper (v2), section 5.1
        gradient_accumulation_steps=1,
        steps_per_generation=4,  # partition rollout batch into 4 mini-batches
        max_steps=2,
    )
    dataset = Dataset.from_list([{"prompt": f"The number {i} is"} for i in range(4)])
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
    trained(trainer, 2)
    # The second step trains on the rollout sampled before the first update, as GSPO's setting intends.
    assert trainer.args.reuses_rollouts_across_updates and trainer.args.generation_batch_size == 32


@pytest.mark.parametrize("logging_steps", [10, None])
def test_the_end_of_training_entry_carries_the_pending_metrics(model_folder, logging_steps):
    """TRL's `log` merges the metrics a logging window gathered into whatever it logs: three steps with TRL's
    `logging_steps=10` log no step, and the end-of-training entry (`train_runtime`) carries the reward, each reward
    function's mean and standard deviation, and the rest, as TRL's own tests read them from `log_history[-1]`.
    With colograd's default (every step logged) the end-of-training entry carries the last step's again."""
    dataset = Dataset.from_list([{"prompt": chat("What is 2+2?"), "solution": "4"}])

    def short(completions, **kwargs):
        return [-len(c[0]["content"]) / 10 for c in completions]

    logging = {"logging_steps": logging_steps} if logging_steps else {}
    args = GRPOConfig(max_completion_length=16, report_to="none", **logging)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=short, args=args, train_dataset=dataset)
    trainer.train()
    last = trainer.state.log_history[-1]
    assert trainer.state.global_step == 3 and "train_runtime" in last
    assert {"reward", "reward_std", "rewards/short/mean", "rewards/short/std", "completions/mean_length"} <= set(last)
    assert last["reward"] == pytest.approx(last["rewards/short/mean"])
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == (0 if logging_steps else 3)
    if steps:
        window = ("reward", "reward_std", "rewards/short/mean", "completions/mean_length")
        assert {k: last[k] for k in window} == {k: steps[-1][k] for k in window}
