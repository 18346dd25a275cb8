"""The per-request agent loop on the real engine, and the tool runner on its own.

The tiny models write random characters, so the tests use `MarkerToolParser`: a turn that ends with ";" calls
`count(text)`, whose result (the length of the turn's text, as digits) is inserted after the ";". The engine
really samples every model token, the tool really runs, and its tokens really go back into the engine.
"""

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from colograd import GRPOConfig
from colograd.agents.core import AgentLoop, Trajectory, turn_sampling_params
from colograd.agents.tools import HermesToolParser, MarkerToolParser, ToolCall, ToolRunner, plain_result_ids
from colograd.engine.core import Engine
from colograd.engine.rollout import Rollout
from colograd.engine.sync import WeightPlan
from colograd.forward.batch import pad_rollout
from colograd.forward.logps import completion_logps
from colograd.models import tiny
from colograd.runs.preemption import StepFailure

COUNTED: list[str] = []


def count(text: str) -> str:
    """The number of characters of a text.

    Args:
        text: the text to measure.
    """
    COUNTED.append(text)
    return str(len(text))


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny.build_model().eval()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("agents")), per_device_train_batch_size=16,
                      num_generations=4, max_prompt_length=16, max_completion_length=48, vllm_kv_cache_gib=0.1,
                      vllm_enforce_eager=True, report_to="none")  # fmt: skip
    engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    return engine, model, tokenizer, args


def run_loop(engine, tokenizer, args, max_iterations=None, seed=0, tap=None):
    parser = MarkerToolParser(";", "count", "text")
    runner = ToolRunner(timeout=5.0)
    requests = replace(engine.requests(), tap=tap)  # the loop reads log-probs from `tap`, or (None) vLLM's objects
    loop = AgentLoop(requests, tokenizer, parser, plain_result_ids(tokenizer), runner, args.max_completion_length,
                     max_iterations)  # fmt: skip
    prompts = [tokenizer(p)["input_ids"] for p in ("abcd>b:", "dcba>a:", "aaaa>c:", "bbbb>d:")]
    samples = [p for p in prompts for _ in range(4)]  # G=4, each sample its own trajectory and seed
    trajectories = [Trajectory(p, {"count": count}, seed=seed + 100 * i) for i, p in enumerate(samples)]
    loop.run(trajectories, turn_sampling_params(args, parser.stop))
    runner.close()
    return trajectories


@pytest.mark.slow
def test_tool_call_mid_completion_is_answered_and_log_probs_match_the_trainer(engine_and_model):
    engine, model, tokenizer, args = engine_and_model
    COUNTED.clear()
    trajectories = run_loop(engine, tokenizer, args)
    semi = tokenizer.convert_tokens_to_ids(";")
    called = [t for t in trajectories if t.calls]
    assert len(called) >= 3 and sum(t.calls for t in called) == len(COUNTED) and all(t.failures == 0 for t in called)
    # The G samples of a prompt differ (a seed per request).
    assert len({tuple(t.ids) for t in trajectories[:4]}) == 4
    continued = 0
    for t in called:
        assert len(t.ids) == len(t.logps) == len(t.tool_mask) <= args.max_completion_length
        assert t.turns == t.calls + 1 or t.truncated
        # Each inserted run of tokens follows a ";" the model sampled, and is the tool's answer to the turn before.
        turn_start = j = 0
        while j < len(t.ids):
            if t.tool_mask[j] == 0:
                end = j
                while end < len(t.ids) and t.tool_mask[end] == 0:
                    end += 1
                assert t.ids[j - 1] == semi and t.tool_mask[j - 1] == 1
                turn_text = tokenizer.decode(t.ids[turn_start : j - 1])
                assert t.ids[j:end] == tokenizer(str(len(turn_text)))["input_ids"]
                continued += end < len(t.ids)  # the model went on after the result
                turn_start = j = end
            else:
                j += 1
    assert continued >= 2

    # The engine's log-probs of the model's tokens equal the trainer's, across turns (fp32).
    rollout = Rollout([t.ids for t in trajectories], [t.logps for t in trajectories],
                      [t.truncated for t in trajectories], tool_mask=[t.tool_mask for t in trajectories])  # fmt: skip
    batch = pad_rollout([t.prompt_ids for t in trajectories], rollout, torch.zeros(16), 1, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_NT = completion_logps(model, batch)
    sampled = batch["tool_mask"].bool()
    assert sampled.sum() > (batch["completion_ids"] != 0).sum() * 0.5
    assert (trainer_NT - batch["engine_logps"])[sampled].abs().max() < 1e-5
    assert (batch["completion_mask"] == batch["tool_mask"]).all()


@pytest.mark.slow
def test_max_tool_calling_iterations_bounds_the_turns(engine_and_model):
    engine, _, tokenizer, args = engine_and_model
    trajectories = run_loop(engine, tokenizer, args, max_iterations=1, seed=1)
    assert max(t.calls for t in trajectories) == 1
    # A trajectory that asked for a second tool ends at that call, truncated.
    second = [t for t in trajectories if t.turns == 2 and not t.truncated]
    stopped = [
        t for t in trajectories if t.calls == 1 and t.truncated and t.ids[-1] == tokenizer.convert_tokens_to_ids(";")
    ]
    assert second or stopped
    assert all(t.turns <= 2 for t in trajectories)


@pytest.mark.slow
def test_turns_read_their_log_probs_from_the_sampler_tap(engine_and_model, objects_built):
    """The same seeded trajectories, their turns' log-probs read from vLLM's Logprob objects and from the sampler
    tap, by turn (request `i.turn`, its prompt the trajectory so far): the same values, and no object built."""
    engine, _, tokenizer, args = engine_and_model
    tap = engine.sampler_tap()
    assert tap is not None
    objects = run_loop(engine, tokenizer, args, seed=2)
    assert objects_built
    objects_built.clear()
    tapped = run_loop(engine, tokenizer, args, seed=2, tap=tap)
    assert not objects_built and tap.installed
    assert sum(t.turns > 1 for t in tapped) >= 3  # later turns: their prompts hold earlier turns and tool results
    for a, b in zip(objects, tapped, strict=True):
        assert a.ids == b.ids and a.tool_mask == b.tool_mask  # seeded: the same trajectories
        assert len(b.logps) == len(b.ids)
        assert max((abs(x - y) for x, y in zip(a.logps, b.logps, strict=True)), default=0.0) <= 1e-6  # NaN fails


@pytest.mark.slow
def test_a_missed_tap_leaves_the_turns_unscored_and_is_uninstalled(engine_and_model, monkeypatch, caplog):
    """Turns cannot be sampled again (their tools have run): where the tap misses them, their tokens are NaN, the
    engine's mark for a token it could not score, inserted tokens keep 0.0, and the tap is uninstalled with one
    warning. (The last test on the module's engine to use its tap.)"""
    import logging
    import math

    engine, _, tokenizer, args = engine_and_model
    tap = engine.sampler_tap()
    assert tap is not None and tap.installed
    monkeypatch.setattr(tap, "request_logps", lambda requests: None)
    with caplog.at_level(logging.WARNING, logger="colograd.agents.core"):
        trajectories = run_loop(engine, tokenizer, args, seed=3, tap=tap)
    assert not tap.installed and caplog.text.count("the sampler tap missed") == 1
    for t in trajectories:
        assert all(math.isnan(x) == (m == 1) for x, m in zip(t.logps, t.tool_mask, strict=True))
        assert all(x == 0.0 for x, m in zip(t.logps, t.tool_mask, strict=True) if m == 0)
    again = run_loop(engine, tokenizer, args, seed=3, tap=tap)  # uninstalled: the objects
    assert not any(math.isnan(x) for t in again for x in t.logps)


def test_tool_runner_turns_raises_timeouts_and_unknown_tools_into_error_results():
    def boom(x: int) -> int:
        raise RuntimeError("no luck")

    def slow(x: int) -> int:
        time.sleep(2)
        return x

    async def double(x: int) -> int:
        await asyncio.sleep(0.01)
        return 2 * x

    runner = ToolRunner(timeout=0.3)
    tools = {"boom": boom, "slow": slow, "double": double}
    calls = [ToolCall("double", {"x": 4}), ToolCall("boom", {"x": 1}), ToolCall("slow", {"x": 1}),
             ToolCall("nope", {}), ToolCall("", {}, error="unreadable")]  # fmt: skip
    pending = runner.submit(tools, calls)
    start = time.monotonic()
    while not pending.ready():
        time.sleep(0.01)
    assert time.monotonic() - start < 1.0  # the slow tool is not waited for
    results = pending.results()
    runner.close()
    assert [r.failed for r in results] == [False, True, True, True, True]
    assert results[0].content == "8"
    assert "RuntimeError: no luck" in results[1].content and "timed out" in results[2].content
    assert "'nope' not found" in results[3].content and "unreadable" in results[4].content


def test_hung_sync_tools_neither_exhaust_threads_nor_keep_the_process_alive():
    import subprocess
    import sys
    import threading

    never = threading.Event()

    def hang(x: int) -> int:
        never.wait()
        return x

    def double(x: int) -> int:
        return 2 * x

    runner = ToolRunner(timeout=0.2)
    hung = runner.submit({"hang": hang}, [ToolCall("hang", {"x": i}) for i in range(100)])  # more than any pool
    while not hung.ready():
        time.sleep(0.01)
    assert all(r.failed and "timed out" in r.content for r in hung.results())
    start = time.monotonic()
    after = runner.submit({"double": double}, [ToolCall("double", {"x": 21})])
    while not after.ready():
        time.sleep(0.01)
    assert after.results()[0].content == "42" and time.monotonic() - start < 0.15  # not queued behind the hung ones
    never.set()  # let this process's hung threads end
    # A process whose tool still hangs ends when its work is done: nothing joins the tool's thread at exit. (The
    # module is loaded from its file: importing the colograd package would load torch and vLLM for nothing.)
    import colograd.agents.tools

    script = (
        "import importlib.util, time\n"
        f"spec = importlib.util.spec_from_file_location('tools', {colograd.agents.tools.__file__!r})\n"
        "tools = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(tools)\n"
        "ToolCall, ToolRunner = tools.ToolCall, tools.ToolRunner\n"
        "def hang(x: int) -> int:\n    time.sleep(3600)\n"
        "p = ToolRunner(timeout=0.1).submit({'hang': hang}, [ToolCall('hang', {'x': 1})])\n"
        "while not p.ready():\n    time.sleep(0.01)\nprint(p.results()[0].failed)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_hermes_parser_reads_the_qwen_format():
    text = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert HermesToolParser().parse(text) == [ToolCall("multiply", {"a": 3, "b": 4})]
    assert HermesToolParser().parse("The answer is 12.") == []
    (bad,) = HermesToolParser().parse("<tool_call>{not json}</tool_call>")
    assert bad.error is not None


def test_agents_refuse_what_they_cannot_do_before_start_up(tmp_path):
    from colograd.agents.core import Agents
    from colograd.config.core import ConfigError

    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    parser = MarkerToolParser(";", "count", "text")
    templated, tokenizer.chat_template = tokenizer.chat_template, None
    with pytest.raises(ConfigError, match="no chat template"):
        Agents(tokenizer, args, tools=[count])
    tokenizer.chat_template = templated

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="type hints and a docstring"):
        Agents(tokenizer, args, tools=[undocumented], parser=parser)
    args.vllm_tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size > 1"):
        Agents(tokenizer, args, tools=[count], parser=parser)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=-1"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", max_tool_calling_iterations=-1)


def wordle_style_rollout_func(prompts: list[str], trainer) -> dict[str, list]:
    """A `rollout_func` in the shape of TRL's examples (e.g. its Wordle one): one episode per prompt (the trainer
    passes each prompt G times), turns of model tokens and environment feedback, `env_mask` 0 on the feedback,
    extra fields for the rewards. The engine is reached as in TRL's colocate mode: `trainer.vllm_generation.llm`."""
    from vllm import SamplingParams

    tokenizer = trainer.processing_class
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "hits": []}
    for episode, prompt in enumerate(prompts):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion, logprobs, env_mask = [], [], []
        for turn in range(2):
            params = SamplingParams(max_tokens=4, logprobs=0, seed=1000 * episode + turn)
            sample = trainer.vllm_generation.llm.generate(
                [{"prompt_token_ids": prompt_ids + completion}], params, use_tqdm=False
            )[0].outputs[0]
            completion += sample.token_ids
            logprobs += [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
            env_mask += [1] * len(sample.token_ids)
            feedback = tokenizer(" ok ", add_special_tokens=False)["input_ids"]
            completion, logprobs, env_mask = completion + feedback, logprobs + [0.0] * 4, env_mask + [0] * 4
        target = prompt[-2]
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(completion)
        out["logprobs"].append(logprobs)
        out["env_mask"].append(env_mask)
        out["hits"].append(float(tokenizer.decode(completion).count(target)))
    return out


def hits_reward(completions, hits, **kwargs):
    return hits


@pytest.mark.slow
def test_rollout_func_replaces_generation(tmp_path, monkeypatch):
    from colograd import GRPOTrainer

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # the module's engine left its launcher variables here
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=8, num_generations=4)
    trainer = GRPOTrainer(tiny.build_model(), hits_reward, args, tiny.letters_dataset(16),
                          processing_class=tiny.build_tokenizer(), rollout_func=wordle_style_rollout_func)  # fmt: skip
    trainer.train()
    (step,) = [h for h in trainer.state.log_history if "loss" in h]
    assert step["rewards/hits_reward/mean"] == step["reward"]
    # The feedback tokens (logprob 0.0 stand-ins) are out of the gap: what is left is engine == trainer.
    assert step["sampling/sampling_logp_difference/max"] < 1e-3
    assert 2 <= step["completions/mean_length"] <= 8  # model tokens only, the feedback not counted


# TRL's echo `rollout_func` example (docs/source/openenv.md, "Before (`rollout_func`)", until TRL removed it with
# `trl.experimental.openenv.generate_rollout_completions` before 1.16), copied below unchanged. Two things around it
# are local: `client` stands in for the echo environment's server (OpenEnv's echo_env: the message comes back,
# reward 0.1 per character), and `generate_rollout_completions`, gone from TRL 1.16, is rebuilt from what TRL 1.16
# offers a rollout_func for it, `trainer.vllm_generation.generate` (TRL's own `_generate_single_turn` calls it so).


class EchoAction:
    def __init__(self, message: str) -> None:
        self.message = message


class LocalEchoEnv:
    def step(self, action: EchoAction):
        from types import SimpleNamespace

        echoed = SimpleNamespace(echoed_message=action.message, reward=0.1 * len(action.message))
        return SimpleNamespace(observation=echoed, reward=echoed.reward, done=False)


client = LocalEchoEnv()
tokenizer = tiny.build_tokenizer()


def generate_rollout_completions(trainer, prompts):
    """TRL's removed helper (colocate mode), on TRL 1.16's `VLLMGeneration.generate`: one completion per prompt."""
    from trl.data_utils import is_conversational

    tok = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in prompts]
    else:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
        prompts=ids, images=None, num_generations=trainer.args.num_generations
    )
    return [
        {"prompt_ids": p, "completion_ids": c, "logprobs": [lp[0] for lp in lps], "text": tok.decode(c)}
        for p, c, lps in zip(prompt_ids, completion_ids, logprobs, strict=True)
    ]


def rollout_func(prompts, trainer):
    outputs = generate_rollout_completions(trainer, prompts)
    env_rewards = []
    for out in outputs:
        text = tokenizer.decode(out["completion_ids"], skip_special_tokens=True)
        result = client.step(EchoAction(message=text))
        env_rewards.append(result.reward)
    return {
        "prompt_ids": [out["prompt_ids"] for out in outputs],
        "completion_ids": [out["completion_ids"] for out in outputs],
        "logprobs": [out["logprobs"] for out in outputs],
        "env_reward": env_rewards,
    }


def reward_from_env(completions, **kwargs):  # TRL's examples/scripts/openenv/catch.py, unchanged
    rewards = kwargs.get("env_reward", [])
    return [float(r) for r in rewards] if rewards else [0.0] * len(completions)


@pytest.mark.slow
def test_trl_echo_rollout_func_runs_unchanged_on_vllm_generation(tmp_path, monkeypatch):
    from colograd import GRPOTrainer

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    data = tiny.letters_dataset(16).map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=8, num_generations=4)
    trainer = GRPOTrainer(tiny.build_model(), reward_from_env, args, data, eval_dataset=data.select(range(3)),
                          processing_class=tokenizer, rollout_func=rollout_func)  # fmt: skip
    # TRL's return shapes: per completion, the prompt's ids, the sampled ids, and [[logprob]] / [[token id]] per token.
    prompt = tokenizer.apply_chat_template(data[0]["prompt"], add_generation_prompt=True, return_dict=False)
    trainer.sync_for_rollout()
    with trainer.engine.awake():
        tap, read = trainer.engine.sampler_tap(), []  # log-probs read from the sampler: no per-token objects
        monkeypatch.setattr(tap, "logps", lambda outputs, real=tap.logps: read.append(len(outputs)) or real(outputs))
        prompt_ids, completion_ids, logprobs, token_ids = trainer.vllm_generation.generate([prompt] * 3, None, 3)
    assert read == [3]  # and the training step's gap below checks what it read
    assert prompt_ids == [prompt] * 3 and len({tuple(c) for c in completion_ids}) == 3  # each entry its own sample
    assert [[t] for t in completion_ids[0]] == token_ids[0] and all(len(lp) == 1 for lp in logprobs[0])
    assert 0 < len(completion_ids[0]) <= args.max_completion_length
    trainer.train()
    # After a rollout, outside one, a CPU engine has released its packed weights: `vllm_generation` syncs it first.
    assert trainer.engine.packed_released is not torch.cuda.is_available()
    assert len(trainer.vllm_generation.generate([prompt], None, 1)[1]) == 1 and not trainer.engine.packed_released
    (step,) = [h for h in trainer.state.log_history if "loss" in h]
    # The environment's reward (0.1 per echoed character) reached the reward function through `env_reward`.
    assert step["rewards/reward_from_env/mean"] == pytest.approx(0.1 * step["completions/mean_length"], rel=0.3)
    assert step["sampling/sampling_logp_difference/max"] < 1e-3  # the engine's log-probs, returned in TRL's shape
    # Evaluation calls the rollout_func too (each eval prompt num_generations_eval times), as TRL's does.
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/reward_from_env/mean"] == pytest.approx(
        0.1 * metrics["eval_completions/mean_length"], rel=0.3
    )


CHATML_WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    """A character-level tokenizer over printable ASCII with ChatML's special tokens and a tool-aware template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHATML_WITH_TOOLS
    return fast


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def test_tool_results_are_inserted_as_the_chat_template_renders_them(tmp_path):
    """Prompt + the model's turn (a Hermes tool call, ended by EOS) + the inserted result tokens is, token for token,
    the chat template's rendering of the whole conversation; the schema comes from the signature and docstring."""
    from colograd.agents.core import Agents
    from colograd.agents.tools import chat_template_result_ids

    tokenizer = chatml_tokenizer()
    agents = Agents(tokenizer, GRPOConfig(output_dir=str(tmp_path), report_to="none"), tools=[multiply])
    assert agents.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert isinstance(agents.parser, HermesToolParser)
    user = [{"role": "user", "content": "What is 3 times 4?"}]
    prompt = tokenizer.apply_chat_template(user, tools=agents.schemas, add_generation_prompt=True, return_dict=False)
    turn_text = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    turn = tokenizer(turn_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    (call,) = agents.parser.parse(tokenizer.decode(turn))
    result = multiply(**call.arguments)
    inserted = chat_template_result_ids(tokenizer)([{"role": "tool", "name": call.name, "content": str(result)}])
    call_message = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    conversation = user + [
        {"role": "assistant", "content": "", "tool_calls": [call_message]},
        {"role": "tool", "name": "multiply", "content": "12"},
    ]
    whole = tokenizer.apply_chat_template(
        conversation, tools=agents.schemas, add_generation_prompt=True, return_dict=False
    )
    assert prompt + turn + inserted == whole
    text = tokenizer.decode(inserted)
    assert "<tool_response>\n12\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_turn_logic_bounds_the_length_and_the_tool_turns():
    """`end_turn` / `insert_results` on hand-made engine outputs (pure logic, no engine)."""
    from types import SimpleNamespace

    from colograd.agents.tools import ToolResult

    tokenizer = tiny.build_tokenizer()
    parser = MarkerToolParser(";", "count", "text")

    def sample(text, finish_reason="stop"):
        ids = tokenizer(text)["input_ids"]
        return SimpleNamespace(token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids],
                               finish_reason=finish_reason)  # fmt: skip

    loop = AgentLoop(None, tokenizer, parser, plain_result_ids(tokenizer), None, max_completion_length=10)
    t = Trajectory([5], {"count": count})
    assert loop.end_turn(t, sample("abc;")) == [ToolCall("count", {"text": "abc"})]
    assert loop.insert_results(t, [ToolResult("count", "3", False)]) and t.tool_mask == [1, 1, 1, 1, 0]
    assert loop.end_turn(t, sample("ab;")) and t.turns == 2
    # 8 tokens so far: a 2-token result would leave no room for the model's next token; it is counted, not inserted.
    assert not loop.insert_results(t, [ToolResult("count", "12", True)])
    assert t.truncated and t.calls == 2 and t.failures == 1 and len(t.ids) == 8
    cut = Trajectory([5], {})
    assert loop.end_turn(cut, sample("abcdefghij", "length")) == [] and cut.truncated
    no_tools = AgentLoop(None, tokenizer, parser, plain_result_ids(tokenizer), None, 10, max_tool_calling_iterations=0)
    asked = Trajectory([5], {})
    assert no_tools.end_turn(asked, sample("ab;")) == [] and asked.truncated


class Oracle:
    """An environment whose tool reveals the letter the prompt hides ("abcd>?:" instead of "abcd>b:")."""

    def reset(self, prompt: str, target: str, **row) -> None:
        self.target, self.peeked = target, False

    def peek(self, text: str) -> str:
        """The hidden letter.

        Args:
            text: ignored.
        """
        self.peeked = True
        return self.target


def solved(completions, environments, **kwargs):
    """The tiny task's reward, given only to completions that asked the tool: without it the letter is unknown."""
    return [
        c.count(e.target) / len(c) if e.peeked and c else 0.0 for c, e in zip(completions, environments, strict=True)
    ]


def test_a_prepare_prompts_override_without_tools_is_refused_where_environments_pass_theirs(tmp_path):
    """Environments template their prompts again with their own schemas, as an argument of `prepare_prompts`: an
    override that cannot take it is refused in one line at start-up, not at the first tool turn."""
    from colograd import GRPOTrainer
    from colograd.agents.core import Agents
    from colograd.config.core import ConfigError

    class Plain(GRPOTrainer):
        def prepare_prompts(self, rows):
            return super().prepare_prompts(rows)

    class Passing(GRPOTrainer):
        def prepare_prompts(self, rows, tools=None):
            return super().prepare_prompts(rows, tools)

    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    agents = Agents(tokenizer, args, environment_factory=Oracle)
    with pytest.raises(ConfigError, match=r"^Plain.prepare_prompts takes no `tools` argument.*tools=None"):
        agents.check_stages(Plain)
    agents.check_stages(Passing)
    agents.check_stages(GRPOTrainer)
    Agents(tokenizer, args, tools=[count]).check_stages(Plain)  # no environment: nothing passes its own


@pytest.mark.slow
def test_a_task_only_a_tool_solves_is_learned(tmp_path, monkeypatch):
    from colograd import GRPOTrainer

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    data = tiny.letters_dataset(256).map(lambda row: {"prompt": row["prompt"][:5] + "?:"})
    args = tiny.run_config(str(tmp_path), 8, learning_rate=3e-3, max_completion_length=12)
    parser = MarkerToolParser(";", "peek", "text")
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = None  # the letter comes back as the parser's plain text, not as a chat turn
    trainer = GRPOTrainer(tiny.build_model(), solved, args, data, processing_class=tokenizer,
                          environment_factory=Oracle, tool_call_parser=parser)  # fmt: skip
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    first, last = sum(h["reward"] for h in steps[:2]) / 2, sum(h["reward"] for h in steps[-2:]) / 2
    assert last > first + 0.2, f"reward went from {first:.2f} to {last:.2f}"
    assert steps[-1]["tools/call_frequency"] > steps[0]["tools/call_frequency"]


class Tally:
    """A second environment, for runs that mix environments: its tool counts the target letter."""

    def reset(self, prompt: str, target: str, **row) -> str:
        self.target, self.tallied = target, 0
        return "!"

    def tally(self, text: str) -> str:
        """How often the target letter occurs in a text.

        Args:
            text: the text to look at.
        """
        self.tallied += 1
        return str(text.count(self.target))

    def get_reward(self) -> float:
        return float(self.tallied > 0)


class TwoToolParser:
    """A turn that ends with ";" calls `peek`, one that ends with "." calls `tally`, with the turn's text."""

    stop = [";", "."]

    def parse(self, text: str) -> list[ToolCall]:
        tool = {";": "peek", ".": "tally"}.get(text[-1:])
        return [ToolCall(tool, {"text": text[:-1]})] if tool else []


@pytest.mark.slow
def test_environments_by_name_and_evaluation_run_the_agent_loop(tmp_path, monkeypatch):
    """TRL's dict of environment factories: each row's `environment` picks one, its prompt shows only that one's
    tools, and its completion may call only those; `get_reward` scores only its own class's completions. Then
    `evaluate` runs the same loop: the eval prompts' completions call tools and get their environments' rewards."""
    from colograd import GRPOTrainer

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    data = tiny.letters_dataset(32).map(lambda row, i: {"environment": ["oracle", "tally"][i % 2]}, with_indices=True)
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=32, num_generations=4,
                           max_completion_length=16, num_generations_eval=2)  # fmt: skip
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = None
    shown: list[list[str]] = []
    seen: dict[str, list] = {}

    class Recording(GRPOTrainer):
        def prepare_prompts(self, rows, tools=None):
            shown.append(sorted(s["function"]["name"] for s in tools or self.agents.schemas))
            return super().prepare_prompts(rows, tools)

        def generate(self, prompt_ids, context, images=None):
            rollout = super().generate(prompt_ids, context, images)
            seen.update(rows=context.rows, environments=rollout.columns["environments"])
            return rollout

    trainer = Recording(tiny.build_model(), "letters", args, data, eval_dataset=data.select(range(8)),
                        processing_class=tokenizer, environment_factory={"oracle": Oracle, "tally": Tally},
                        tool_call_parser=TwoToolParser())  # fmt: skip
    trainer.train()
    envs = seen["environments"]
    kinds = {"oracle": Oracle, "tally": Tally}
    assert [type(e) for e in envs] == [kinds[row["environment"]] for row in seen["rows"] for _ in range(4)]
    assert shown[0] == ["peek", "tally"] and ["peek"] in shown and ["tally"] in shown  # first all, then each its own
    assert any(getattr(e, "peeked", False) or getattr(e, "tallied", 0) for e in envs)
    (step,) = [h for h in trainer.state.log_history if "loss" in h]
    # A completion that calls the other environment's tool gets "not found": both markers are sampled by chance.
    assert 0 < step["tools/failure_frequency"] < 1
    assert "rewards/Tally/mean" in step and "rewards/Oracle/mean" not in step  # Oracle owns no reward
    metrics = trainer.evaluate()
    assert len(seen["environments"]) == 8 * 2  # the eval prompts, num_generations_eval each
    assert metrics["eval_tools/call_frequency"] > 0 and 0 <= metrics["eval_tools/failure_frequency"] <= 1
    assert "eval_rewards/Tally/mean" in metrics and metrics["eval_completions/mean_length"] <= 16
    with pytest.raises(StepFailure, match="stage 'eval_generate': ValueError: .*environment='nowhere'"):
        trainer.evaluate(data.select(range(2)).map(lambda row: {"environment": "nowhere"}))
