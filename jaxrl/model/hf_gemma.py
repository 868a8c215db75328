"""Gemma 2's and Gemma 3's config.json keys (`hf_config` reads and writes the rest): their
refusals and softcaps, Gemma 3's per-layer-type RoPE, the keys they write, and the language
model of Gemma 3's multimodal checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_rope import get_key, layered_rope, refuse
from jaxrl.model.safetensors_io import CheckpointError

# Gemma3TextConfig's defaults: the full-attention layers' RoPE base, the sliding layers', the
# window, one full layer in this many, query_pre_attn_scalar.
GEMMA_THETA, GEMMA_LOCAL_THETA, GEMMA_WINDOW, GEMMA_PATTERN, GEMMA_QUERY_SCALAR = (
  1_000_000.0,
  10_000.0,
  4096,
  6,
  256,
)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Gemma2Config's softcaps where config.json has no key (Gemma 3's are none); null turns one off.
_SOFTCAPS = {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}

MULTIMODAL = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text")}
"""Multimodal model types whose language model jaxrl reads: -> (architecture, text model type).
Their tensors: `jaxrl.model.hf.language_model_tensors`."""


def is_multimodal(config: Mapping[str, Any]) -> bool:
  return config.get("model_type") in MULTIMODAL


def language_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
  """The config.json of a checkpoint's language model: `config` itself, or for a multimodal
  checkpoint (Gemma 3 4B and up) its `text_config` as the text model's config.json, with the
  top level's `tie_word_embeddings` (its key, or true) where the text config has none."""
  if not is_multimodal(config):
    return config
  model_type = config["model_type"]
  architecture, text_type = MULTIMODAL[model_type]
  archs = config.get("architectures")
  if archs is not None and list(archs) != [architecture]:
    raise CheckpointError(
      f"config.json: architectures={archs!r} does not match model_type={model_type!r}; "
      f"jaxrl reads the language model of {architecture} for it."
    )
  text = config.get("text_config")
  if not isinstance(text, Mapping):
    raise CheckpointError(
      f"config.json: model_type={model_type!r} needs a text_config dict (the language model's "
      f"settings), got {text!r}."
    )
  if text.get("model_type", text_type) != text_type:
    raise CheckpointError(
      f"config.json: text_config.model_type={text['model_type']!r}; expected {text_type!r}."
    )
  tied = config.get("tie_word_embeddings", True)
  return {"tie_word_embeddings": tied, **text, "model_type": text_type, "architectures": None}


def gemma_refusals(config: Mapping[str, Any]) -> None:
  refuse(
    config,
    "hidden_activation",
    lambda v: v == "gelu_pytorch_tanh",
    "jaxrl's Gemma MLP is GeGLU with the tanh GELU (gelu_pytorch_tanh)",
  )
  refuse(config, "hidden_act", lambda v: v == "gelu_pytorch_tanh", "see hidden_activation")
  refuse(config, "attention_bias", lambda v: not v, "jaxrl has no attention biases here")
  refuse(config, "use_bidirectional_attention", lambda v: not v, "jaxrl's attention is causal")


def gemma_softcaps(config: Mapping[str, Any], model_type: str) -> dict[str, float]:
  """`final_logit_softcap` and `attention_logit_softcap` (0: none)."""
  out = {}
  for key, field in (
    ("final_logit_softcapping", "final_logit_softcap"),
    ("attn_logit_softcapping", "attention_logit_softcap"),
  ):
    cap = config.get(key, _SOFTCAPS[key] if model_type == "gemma2" else None)
    if cap is not None:
      cap = get_key({key: cap}, key, kind=float)
      if cap <= 0:
        raise CheckpointError(f"config.json: {key}={cap}; expected null or > 0.")
      out[field] = cap
  return out


def gemma_rope(
  config: Mapping[str, Any], max_positions: int, *, head_dim: int, local: bool
) -> dict[str, Any]:
  """Gemma 3's RoPE (`layered_rope`): Hub files give `rope_theta`, `rope_scaling` and the
  sliding layers' `rope_local_base_freq`."""
  local_theta = config.get("rope_local_base_freq", GEMMA_LOCAL_THETA)
  return layered_rope(
    config, max_positions, head_dim=head_dim, local=local, theta=GEMMA_THETA,
    local_theta=local_theta,
  )  # fmt: skip


def gemma_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
  """Gemma 2's and 3's keys, in the Hub's layout (`rope_local_base_freq`, `layer_types`)."""
  del out["hidden_act"]
  scale = cfg.attention_logit_scale
  out |= {
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": round(scale**-2) if scale else cfg.head_dim,
    "sliding_window": cfg.sliding_window or None,
    "layer_types": [
      "sliding_attention" if i in cfg.sliding_layers else "full_attention"
      for i in range(cfg.num_layers)
    ],
    "final_logit_softcapping": cfg.final_logit_softcap or None,
    "attn_logit_softcapping": cfg.attention_logit_softcap or None,
    "use_bidirectional_attention": False,
  }
  if out["model_type"] == "gemma3_text":
    out["rope_local_base_freq"] = cfg.local_rope_theta or GEMMA_LOCAL_THETA
