"""The zoo (tests/zoo.py) through a real run: preflight, engine start and one GRPO step for each published config,
shrunk in width and depth only, with TRL's quickstart settings and with the Qwen recipe's.

TRL's quickstart settings are GRPOConfig's defaults (8 completions of up to 512 tokens per prompt, no prompt limit,
one prompt per step) with a few in-memory chat prompts; the engine is eager (no compilation: seconds, not tens of
seconds, on a CPU) and each model is edited to end its answers after a few tokens (`zoo.stopping_model`), so that
one step takes seconds. The sampling gap (the engine's log-prob of each sampled token against the trainer's) is
the parity check: rope type and scaling, windows, head layout and tying are right in the engine when it is ~1e-5.
"""

import pytest
import torch
import yaml
import zoo
from datasets import Dataset, IterableDataset

from colograd import GRPOConfig, GRPOTrainer
from colograd.config.core import ConfigError
from colograd.engine import kv_cache, moe
from colograd.engine import launch as engine_launch
from colograd.grpo.parity import ParityError
from colograd.rewards.core import resolve_reward

pytestmark = pytest.mark.slow

ROOT_RECIPE = "recipes/grpo_qwen.yaml"
QUESTIONS = ["what is 2+2?", "name a colour.", "say yes.", "(1+3)*2=?"]
# One model of each dense architecture the zoo holds, for the recipe's settings (the quickstart runs every model).
ARCHITECTURES = {
    "qwen2": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen3": "Qwen/Qwen3-0.6B",
    "llama": "meta-llama/Llama-3.2-1B-Instruct",
    "gemma3_text": "google/gemma-3-1b-it",
    "phi3": "microsoft/Phi-4-mini-instruct",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
}


def answer_length(completions: list, **kwargs) -> list[float]:
    """A reward any completion gets: its length's remainder by 3 (varied, so that advantages are not all zero)."""
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 3) for t in text]


def chat_rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]


def one_step(name: str, args: GRPOConfig, dataset, reward_funcs=answer_length) -> GRPOTrainer:
    """Train `name`'s stopping model one step on `dataset`; return the trainer."""
    model, tokenizer = zoo.stopping_model(name)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.state.global_step == 1
    return trainer


def step_log(trainer: GRPOTrainer) -> dict:
    return next(h for h in trainer.state.log_history if "loss" in h)


def engine_specs(trainer: GRPOTrainer) -> dict:
    """The KV cache spec of each layer, as the trainer's engine reported them to vLLM."""
    return trainer.engine.llm.collective_rpc(lambda worker: worker.get_kv_cache_spec())[0]


def spec_key(spec) -> tuple:
    return (type(spec).__name__, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
            getattr(spec, "sliding_window", None), spec.page_size_bytes)  # fmt: skip


# The sampling gap of an fp32 step whose engine runs the trainer's model (sharp weights: a few 1e-5 at most).
GAP_BOUND = 1e-3

# Mixture-of-Experts models: trained by their own test (their engine's experts and KV layers are checked there).
MOE = [name for name, published in zoo.ZOO.items() if any(key in published for key in moe.EXPERT_COUNTS)]


@pytest.mark.parametrize("name", [name for name in zoo.ZOO if name not in MOE])
def test_quickstart_settings_train_every_model(name, tmp_path, record_property):
    """TRL's defaults, an in-memory dataset: every prompt is measured, so the engine's context is the longest prompt
    and a 512-token completion. The engine's layers are the ones the fast KV test hands vLLM's start-up check."""
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True)  # fmt: skip
    trainer = one_step(name, args, Dataset.from_list(chat_rows()))
    log = step_log(trainer)
    record_property("sampling_gap", log["sampling/sampling_logp_difference/max"])  # --junitxml lists each model's
    assert log["sampling/sampling_logp_difference/max"] <= GAP_BOUND  # fp32, sharp weights: the same model
    assert trainer.parity.running  # the gate found the training pass equal to the evaluation pass: no noise
    assert 1 <= log["completions/mean_length"] < 64  # the stopping model answers in a few tokens
    tokenizer = trainer.processing_class
    rows = chat_rows()
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    engine_context = trainer.engine.llm.llm_engine.model_config.max_model_len
    assert engine_context == longest + args.max_completion_length < zoo.ZOO[name]["max_position_embeddings"]
    config = trainer.model.config
    block = trainer.engine.llm.llm_engine.vllm_config.cache_config.block_size
    real = sorted(map(spec_key, engine_specs(trainer).values()))
    assert real == sorted(map(spec_key, zoo.kv_specs(config, block, torch.float32).values()))


def test_a_model_configured_layer_by_layer_is_sized_from_its_specs_and_trains(tmp_path):
    """Gemma 4's text model keeps its attention shapes per layer in transformers' config (`per_layer_config`: heads of
    256 on its sliding layers, 512 on its global ones), where reading one global `head_dim` raises: no one count of
    KV bytes per token exists. Its cache is sized from the specs its engine's layers report, as a hybrid's is, and a
    quickstart step trains exact. Gemma 4 as transformers' default config gives it (`zoo.from_defaults`: no published
    config in the zoo)."""
    name = zoo.from_defaults("gemma4_text")
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=64)  # fmt: skip
    trainer = one_step(name, args, Dataset.from_list(chat_rows() * 4))
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= GAP_BOUND
    assert {spec.head_size for spec in engine_specs(trainer).values()} == {256, 512}
    config = trainer.model.config
    assert kv_cache.unsized_layers(config) is not None and trainer.engine.kv_cache_bytes > 0


def test_gemma_3n_trains_with_its_per_layer_embeddings_and_shared_kv_layers(tmp_path):
    """Gemma-3n's text model (transformers' default config, its E4B's shape; `zoo.shrunk` keeps a KV-sharing half):
    each layer adds a per-layer token embedding to its input, and its last layers read the KV cache of earlier ones.
    vLLM's text-only class dropped the per-layer embeddings (0.06 nats at the first rollout: the gate stopped it,
    `colograd.engine.vllm_models`); the engine holds pages for the layers that compute a KV cache only, and a
    quickstart step trains exact."""
    name = zoo.from_defaults("gemma3n_text")
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=64)  # fmt: skip
    trainer = one_step(name, args, Dataset.from_list(chat_rows() * 4))
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= GAP_BOUND
    config = trainer.model.config
    assert 0 < config.num_kv_shared_layers < config.num_hidden_layers
    assert len(engine_specs(trainer)) == config.num_hidden_layers - config.num_kv_shared_layers


def test_minimax_m2s_experts_reach_the_engine_where_vllm_names_them_otherwise(tmp_path):
    """vLLM's MiniMax-M2 holds its experts under `block_sparse_moe.experts` (as its checkpoints name them) but names
    the layers `mlp.experts`: the sync sorted the expert weights by that name, sent them to the reload instead of the
    prepacked experts' own path, and the engine computed with stale experts (5.2 nats at the first rollout, the gate
    stopped it, a fresh load naming `w13_weight` and `w2_weight`). A quickstart step trains exact."""
    name = zoo.from_defaults("minimax_m2")  # with its published config's keys (`zoo.PUBLISHED_KEYS`)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=64)  # fmt: skip
    trainer = one_step(name, args, Dataset.from_list(chat_rows() * 4))
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= GAP_BOUND


def rope_without_scaling(config) -> None:
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}


def rope_base_of_10k(config) -> None:
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 10000.0}


# Errors the parity check must see, each in the engine's model alone (the config it is started from), as a rope, a
# soft-cap or a logit scale lost on the way to the engine would be: the model, and the error injected into it.
MUTATIONS = {
    "rope scaling dropped": ("meta-llama/Llama-3.2-1B-Instruct", rope_without_scaling),
    "rope base changed": ("Qwen/Qwen3-0.6B", rope_base_of_10k),
    "logit soft-cap dropped": ("google/gemma-2-2b-it", lambda c: setattr(c, "final_logit_softcapping", None)),
    "logits scaled": ("ibm-granite/granite-3.1-2b-instruct", lambda c: setattr(c, "logits_scaling", 1.0)),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_parity_check_fails_on_a_wrong_model_in_the_engine(mutation, tmp_path, monkeypatch, record_property):
    """The parity gate has power: with one error injected into the engine's model, the same step is stopped before
    it trains (with transformers' flat 0.02 weights, a dropped rope scaling moved the gap by 1e-6)."""
    name, mutate = MUTATIONS[mutation]
    own = engine_launch.engine_config

    def mutated(model):
        config = own(model)
        mutate(config)
        return config

    monkeypatch.setattr(engine_launch, "engine_config", mutated)
    # The parity gate (engine_parity: error, the default) stops the run before it trains: its line gives the gap.
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=64)  # fmt: skip
    model, tokenizer = zoo.stopping_model(name)
    trainer = GRPOTrainer(model=model, reward_funcs=answer_length, args=args,
                          train_dataset=Dataset.from_list(chat_rows()), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ParityError) as err:
        trainer.train()
    record_property("sampling_gap", str(err.value).split(" nats from")[0].rsplit(" ", 1)[-1])
    assert trainer.state.global_step == 0


# An 8k and a 128k model, started at their own context: prompts from a stream are not all
# measured, so the engine keeps the model's context, and the cache its floor (the start-up TRL's quickstart failed).
@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-3.2-1B-Instruct"])
def test_a_stream_starts_the_engine_at_the_models_own_context(name, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True)  # fmt: skip
    stream = IterableDataset.from_generator(lambda: iter(chat_rows() * 4))
    trainer = one_step(name, args, stream)
    context = zoo.ZOO[name]["max_position_embeddings"]
    assert trainer.engine.llm.llm_engine.model_config.max_model_len == context
    per_token = kv_cache.kv_bytes_per_token(trainer.model.config, torch.float32)
    assert trainer.engine.kv_cache_bytes >= (context + 1) * per_token  # one whole-context sequence fits
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-4


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_recipe_settings_train_each_architecture(architecture, tmp_path):
    """recipes/grpo_qwen.yaml's training settings (bf16 autocast and engine, prompts of up to 512 tokens and
    completions of up to 1,024, DAPO's clipping, gradient checkpointing, prefix caching), one prompt's 2 completions
    per step instead of 64 × 8 (the step's size is not what is checked, and a bf16 forward and backward through a
    150-260k-token head runs at ~8 tokens/s on a 2-core CPU)."""
    with open(ROOT_RECIPE) as f:
        recipe = yaml.safe_load(f)
    fields = {f for f in GRPOConfig.__dataclass_fields__}
    settings = {k: v for k, v in recipe.items() if k in fields and k not in ("output_dir", "report_to")}
    settings |= {"per_device_train_batch_size": 2, "num_generations": 2, "gradient_accumulation_steps": 1,
                 "max_steps": 1, "save_strategy": "no", "vllm_enforce_eager": True,
                 "log_completions": False}  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", **settings)
    assert args.bf16 and args.max_prompt_length == 512 and args.max_completion_length == 1024
    rewards = [resolve_reward(name) for name in recipe["reward_funcs"]]  # its math accuracy and <think> format
    rows = [{**row, "solution": "4"} for row in chat_rows()]
    trainer = one_step(ARCHITECTURES[architecture], args, Dataset.from_list(rows), rewards)
    assert trainer.engine.llm.llm_engine.model_config.max_model_len == 512 + 1024
    assert str(trainer.engine.llm.llm_engine.model_config.dtype) == "torch.bfloat16"
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] < 1.0  # bf16 rounds every layer


def test_an_architecture_vllm_cannot_run_is_one_line(tmp_path):
    """A config whose architecture vLLM does not know is refused before the engine starts, in one line naming it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=128, n_layer=2, n_head=2, n_positions=256)
    model = GPT2LMHeadModel(config)
    model.config.architectures = ["NotAModelForCausalLM"]
    tokenizer = zoo.tokenizer_for(config)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", vllm_enforce_eager=True)
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(model=model, reward_funcs=answer_length, args=args,
                    train_dataset=Dataset.from_list(chat_rows()), processing_class=tokenizer)  # fmt: skip
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", MOE)
def test_quickstart_settings_train_every_moe_model(name, tmp_path, record_property):
    """TRL's defaults on each Mixture-of-Experts family vLLM's CPU backend runs (Qwen3-MoE, Mixtral, OLMoE, and
    DeepSeek-V2-Lite with MLA attention), for two steps: the second step's rollout comes from weights the sync wrote
    after the first optimizer step into expert layers the engine prepacked (`colograd.engine.moe`)."""
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True)  # fmt: skip
    model, tokenizer = zoo.stopping_model(name)
    trainer = GRPOTrainer(model=model, reward_funcs=answer_length, args=args,
                          train_dataset=Dataset.from_list(chat_rows()), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert trainer.engine.prepacked_experts
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
    record_property("sampling_gap", max(gaps))
    assert max(gaps) <= GAP_BOUND  # fp32, sharp weights: the same model
    assert all(1 <= h["completions/mean_length"] < 64 for h in steps)
