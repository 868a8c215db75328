"""Granite's keys of a Hugging Face config.json <-> `ModelConfig` (`hf_config` uses these).

IBM's Granite 3 (`GraniteForCausalLM`) is Llama's network with four scalars, and Granite 3 MoE
(`GraniteMoeForCausalLM`: granite-3.x-1b-a400m and -3b-a800m) Mixtral's with the same: the
embeddings times `embedding_multiplier`, each sublayer's output times `residual_multiplier`
before it joins the residual stream, attention logits times `attention_multiplier` (in place
of `head_dim ** -0.5`), and the logits divided by `logits_scaling`. Granite MoE stacks its
experts in `block_sparse_moe.input_linear` (gate rows first) and `output_linear`
(`hf_layout`), and weighs each token's experts by the softmax of their k logits (the top-k
probabilities renormalised).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_rope import get_key
from jaxrl.model.safetensors_io import CheckpointError

GRANITE_FIELDS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
"""ModelConfig fields only Granite sets (besides `attention_logit_scale`)."""
GRANITE_TYPES = ("granite", "granitemoe")
"""Granite 3 and Granite 3 MoE (Mixtral's network with the same scalars)."""


def granite_fields(config: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
  """The ModelConfig fields of Granite's four scalars (transformers' defaults: 1)."""
  fields = {}
  for name in (*GRANITE_FIELDS, "attention_multiplier"):
    value = get_key(config, name, 1.0, float)
    if value <= 0:
      raise CheckpointError(f"config.json: {name}={value}; expected > 0.")
    fields[name] = value
  attention = fields.pop("attention_multiplier")
  if attention != head_dim**-0.5:  # else the default scale
    fields["attention_logit_scale"] = attention
  return fields


def is_granite(cfg: ModelConfig) -> bool:
  return any(getattr(cfg, name) != 1 for name in GRANITE_FIELDS)


def granite_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
  """Adds Granite's keys to a config.json dict being written."""
  out |= {name: getattr(cfg, name) for name in GRANITE_FIELDS}
  out["attention_multiplier"] = cfg.attention_logit_scale or cfg.head_dim**-0.5
