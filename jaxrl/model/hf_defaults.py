"""transformers' defaults per model type, for the keys a Hugging Face config.json may leave out
(the model classes' fields), and the options a model type fixes; `hf_config` reads with them.

The model types (gpt-oss: `hf_gpt_oss`; Granite: `hf_granite`):

Mistral is Llama's network with a sliding attention window in every layer (`sliding_window`:
each position attends to at most that many, itself included; `ModelConfig.sliding_window`);
without a window (null, as in Mistral v0.2 and later) a model saved without its source
checkpoint is written as Llama, the same network.

SmolLM3 is Llama's network with no RoPE in some layers (`no_rope_layers`: 1 rotates, 0 does
not; by default every fourth layer is NoPE): `ModelConfig.nope_layers`. OLMo 2 norms each
sublayer's output rather than its input (`norm_position="post"`) and each token's q and k
projections across all heads (`qk_norm_across_heads`); OLMoE is a pre-norm MoE with those q/k
norms (its `intermediate_size` is one expert's width). Phi-3 (Phi-3, Phi-4) is Llama's network
with fused q/k/v and gate/up tensors (`hf_layout`) and, in some, a sliding window in every
layer; saved without its source it is written as Llama (or Mistral, with a window), except
that Phi-3.5 and Phi-4-mini's LongRoPE (`rope.py`) and Phi-4-mini's partial rotation
(`partial_rotary_factor`: `ModelConfig.rotary_dim`), which only Phi-3's architecture has, are
written as Phi-3. Mixtral is
Mistral's network with MoE MLPs (top-k router weights always renormalised, no q/k norms).
Seed-OSS (`seed_oss`) is Qwen2's network (q/k/v biases, none on the output projection or the
MLP); its attention and residual dropout (0.1, applied only in training by transformers) are
not: jaxrl has no dropout. Saved without its source it is written as Qwen2.

Gemma 3 (`gemma3_text`, Gemma3ForCausalLM: the 1B and 270M checkpoints) norms each sublayer's
input and output ("sandwich"), with scales stored minus one, per-head q/k norms, GeGLU MLPs,
embeddings scaled by sqrt(width), a logit scale of `query_pre_attn_scalar ** -0.5`, and sliding
windows in the layers `layer_types` names "sliding_attention" (by default five in six), which
rotate with their own RoPE base (`rope_local_base_freq`, or `rope_parameters` per layer type);
the scaling applies to the full-attention layers. Gemma 2 (`gemma2`) is the same network
without q/k norms, with one RoPE, a window in every other layer (the first sliding), and its
logits softcapped: attention logits at `attn_logit_softcapping` (50), the head's at
`final_logit_softcapping` (30).

GLM-4 (`glm4`: GLM-4-0414, GLM-Z1) norms each sublayer's input and output like Gemma but with
plain scales (its `post_self_attn_layernorm` and `post_mlp_layernorm`), has q/k/v biases, fuses
the MLP's gate and up (`gate_up_proj`), and rotates the first `partial_rotary_factor` of each
head in interleaved pairs (2i, 2i + 1), which the reader reorders to jaxrl's layout.
ERNIE 4.5 (`ernie4_5`, the 0.3B) is Llama's network with GLM's interleaved rotation of the
whole head; saved without its source it is written as Llama, q and k in Llama's layout.
OLMo 3 is OLMo 2's network with windows (`hf_layers`); EXAONE 4 is OLMo 2's post-norms with
per-head q/k norms, its hybrid models' global layers without RoPE; Qwen2-MoE has a gated
shared expert.
"""

from __future__ import annotations

from jaxrl.model.hf_gemma import GEMMA_PATTERN, GEMMA_THETA, GEMMA_WINDOW
from jaxrl.model.hf_gpt_oss import GPT_OSS_WINDOW

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
  "glm4": 131_072,
  "ernie4_5": 131_072,
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
  "glm4": 1.5625e-07,
  "ernie4_5": 1e-5,
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
  "glm4": 2,
  "ernie4_5": 2,
  "qwen2": 32,
  "qwen3": 32,
  "qwen3_moe": 4,
  "smollm3": 4,
  "gemma2": 4,
  "gemma3_text": 4,
}
# Model types with a sliding window in every layer, and transformers' default for it.
WINDOW = {"mistral": 4096, "phi3": None, "mixtral": None}
# Model types whose windows are in the layers `layer_types` names: (the default window, the
# default pattern: one full layer in this many, the key that overrides that pattern or None).
LAYERED_WINDOWS = {
  "gemma2": (GEMMA_WINDOW, 2, None),  # alternating, the first sliding
  "gemma3_text": (GEMMA_WINDOW, GEMMA_PATTERN, "sliding_window_pattern"),
  "gpt_oss": (GPT_OSS_WINDOW, 2, None),
  "olmo3": (4096, 4, None),
  "exaone4": (4096, 4, "sliding_window_pattern"),  # also a string of L and G
}
# Head widths where config.json has none (others: hidden_size // num_attention_heads).
HEAD_DIM = {
  "qwen3": 128,
  "gemma2": 256,
  "gemma3_text": 256,
  "gpt_oss": 64,
  "seed_oss": 128,
  "glm4": 128,
  "ernie4_5": 128,
}
# Default RoPE bases (others: 10,000); Gemma 3's is its full-attention layers'.
ROPE_THETA = {
  "smollm3": 2_000_000.0,
  "mixtral": 1_000_000.0,
  "gemma3_text": GEMMA_THETA,
  "gpt_oss": 150_000.0,
  "olmo3": 500_000.0,
  "ernie4_5": 500_000.0,
}
GLM4_PARTIAL_ROTATION = 0.5  # Glm4Config's partial_rotary_factor
INTERLEAVED_ROPE = ("glm4", "ernie4_5")  # rotate pairs (2i, 2i + 1), not (i, i + d / 2)
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
TIED = {"smollm3", "gemma2", "gemma3_text", "ernie4_5"}
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
