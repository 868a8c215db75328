"""transformers' defaults per model type, for the keys a Hugging Face config.json may leave out
(the model classes' fields), and the options a model type fixes; `hf_config` reads with them.
"""

from __future__ import annotations

from jaxrl.model.hf_gemma import GEMMA_THETA

# transformers 5's defaults for keys a config.json may leave out (the model classes' fields).
MAX_POSITIONS = {
  "llama": 2048,
  "mistral": 131072,
  "qwen2": 32768,
  "qwen3": 32768,
  "qwen3_moe": 32768,
  "qwen2_moe": 32768,
  "smollm3": 32768,
  "olmo2": 2048,
  "olmo3": 2048,
  "exaone4": 2048,
  "olmoe": 4096,
  "phi3": 4096,
  "mixtral": 131072,
  "gpt_oss": 131072,
  "gemma2": 8192,
  "gemma3_text": 131072,
  "granite": 2048,
  "granitemoe": 2048,
  "seed_oss": 524_288,
}
NORM_EPS = {
  "olmo2": 1e-5,
  "olmo3": 1e-5,
  "exaone4": 1e-5,
  "olmoe": 1e-5,
  "phi3": 1e-5,
  "mixtral": 1e-5,
  "gpt_oss": 1e-5,
}  # others: 1e-6
QK_NORM = {
  "qwen3": "head",
  "qwen3_moe": "head",
  "olmo2": "across",
  "olmo3": "across",
  "exaone4": "head",
  "olmoe": "across",
  "gemma3_text": "head",
}
"""Model types with q/k norms: per head, or across all heads of a token (OLMo's)."""
# transformers' num_key_value_heads where config.json has none (others: num_attention_heads).
KV_HEADS = {
  "mistral": 8,
  "mixtral": 8,
  "gpt_oss": 8,
  "seed_oss": 8,
  "qwen2": 32,
  "qwen3": 32,
  "qwen3_moe": 4,
  "smollm3": 4,
  "gemma2": 4,
  "gemma3_text": 4,
}
# Model types with a sliding window in every layer, and transformers' default for it.
WINDOW = {"mistral": 4096, "phi3": None, "mixtral": None}
# Head widths where config.json has none (others: hidden_size // num_attention_heads).
HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "gpt_oss": 64, "seed_oss": 128}
# Default RoPE bases (others: 10,000); Gemma 3's is its full-attention layers'.
ROPE_THETA = {
  "smollm3": 2_000_000.0,
  "mixtral": 1_000_000.0,
  "gemma3_text": GEMMA_THETA,
  "gpt_oss": 150_000.0,
  "olmo3": 500_000.0,
}
OLMO3_WINDOW, OLMO3_PATTERN = 4096, 4  # Olmo3Config: three sliding layers, then a full one
EXAONE4_WINDOW, EXAONE4_PATTERN = 4096, 4  # Exaone4Config's defaults, the same
# Shape keys a config.json may leave out (the others are required): Gemma 3's multimodal
# checkpoints give only what differs from Gemma3TextConfig's defaults in their text_config.
SHAPE_DEFAULTS = {
  "gemma2": {
    "vocab_size": 256_000,
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "intermediate_size": 9216,
  },
  "gemma3_text": {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "intermediate_size": 9216,
  },
  "gpt_oss": {  # gpt-oss-120b's shapes (GptOssConfig's defaults)
    "vocab_size": 201_088,
    "hidden_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
  },
}
PHI3_ORIGINAL = 4096  # Phi3Config's original_max_position_embeddings, which outranks the scaling's
# Model types whose tie_word_embeddings defaults to true.
TIED = {"smollm3", "gemma2", "gemma3_text"}
NOPE_INTERVAL = 4  # SmolLM3: without no_rope_layers, every fourth layer is NoPE
# MoE model types: transformers' defaults. One expert's width is `moe_intermediate_size` where
# the type has that key, else `intermediate_size` itself.
MOE_DEFAULTS = {
  "qwen3_moe": {
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
  },
  "olmoe": {"num_experts_per_tok": 8, "num_experts": 64, "intermediate_size": 2048},
  "mixtral": {"num_experts_per_tok": 2, "num_experts": 8, "intermediate_size": 14336},
  "gpt_oss": {"num_experts_per_tok": 4, "num_experts": 128, "intermediate_size": 2880},
  "qwen2_moe": {
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
  },
  "granitemoe": {"num_experts_per_tok": 2, "num_experts": 8, "intermediate_size": 11008},
}
# Model types whose router always renormalises its top-k weights (transformers' Mixtral reads
# no norm_topk_prob key; gpt-oss and Granite MoE take the softmax of the top-k logits, the
# same weights); the
# others read it, default false.
ALWAYS_NORM_TOPK = {"mixtral", "gpt_oss", "granitemoe"}
