"""gpt-oss's keys of a Hugging Face config.json <-> `ModelConfig` (`hf_config` uses these).

OpenAI's gpt-oss (`gpt_oss`, GptOssForCausalLM: gpt-oss-20b and gpt-oss-120b) is a pre-norm
MoE transformer with biases on the q/k/v and output projections (`qkv_bias`,
`attention_out_bias`), a learned attention sink per query head (`attention_sinks`), a
128-position window in every other layer (`layer_types`, the first sliding), YaRN RoPE,
a router and experts with biases (`moe_biases`) whose top-k weights are the softmax of the
k chosen logits (renormalised top-k probabilities, the same numbers), and experts with a
clamped SwiGLU (`mlp_activation="clamped_swiglu"`, `swiglu_alpha`, `swiglu_limit`). Its
config.json's `hidden_act` names no activation the model uses. The released checkpoints
hold the experts in MXFP4 (`quantization_config`; `mxfp4.py`, `hf_layout`): jaxrl reads
them and saves unquantised weights, without the `quantization_config`.

transformers' RMSNorm for gpt-oss multiplies by the scale in float32 before rounding (its
norm weights stay float32), jaxrl's rounds first (Llama's order): in bfloat16 the two differ
by a rounding, and not at all in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_rope import get_key, refuse
from jaxrl.model.safetensors_io import CheckpointError

GPT_OSS_WINDOW = 128  # GptOssConfig's sliding_window
# GptOssConfig's RoPE where a config.json gives none.
GPT_OSS_ROPE = {
  "rope_type": "yarn",
  "rope_theta": 150_000.0,
  "factor": 32.0,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "truncate": False,
  "original_max_position_embeddings": 4096,
}
GPT_OSS_OPTIONS = dict(
  qkv_bias=True, attention_out_bias=True, attention_sinks=True, mlp_activation="clamped_swiglu"
)
"""The ModelConfig options every gpt-oss layer has (`moe_biases` too, on its MoE)."""
GPT_OSS_FIELDS = (
  "attention_out_bias",
  "attention_sinks",
  "moe_biases",
  "swiglu_alpha",
  "swiglu_limit",
)
"""ModelConfig fields only gpt-oss sets."""


def with_default_rope(config: Mapping[str, Any]) -> Mapping[str, Any]:
  """`config` with GptOssConfig's YaRN where it gives no RoPE scaling of either layout."""
  if "rope_scaling" in config or "rope_parameters" in config:
    return config
  return {**config, "rope_parameters": GPT_OSS_ROPE}


def gpt_oss_refusals(config: Mapping[str, Any]) -> None:
  refuse(config, "attention_bias", lambda v: v, "jaxrl reads gpt-oss with its attention biases")


def gpt_oss_fields(config: Mapping[str, Any]) -> dict[str, Any]:
  """The clamped SwiGLU's constants and the MoE's biases (the layer options: `_layer_options`)."""
  fields: dict[str, Any] = {"moe_biases": True}
  for name, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
    value = get_key(config, name, default, float)
    if not value > 0:
      raise CheckpointError(f"config.json: {name}={value}; expected > 0.")
    fields[name] = value
  return fields


def gpt_oss_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
  """Adds gpt-oss's keys to a config.json dict being written."""
  out["attention_bias"] = True
  out["swiglu_alpha"], out["swiglu_limit"] = cfg.swiglu_alpha, cfg.swiglu_limit
  out["sliding_window"] = cfg.sliding_window or None
  out["layer_types"] = [
    "sliding_attention" if i in cfg.sliding_layers else "full_attention"
    for i in range(cfg.num_layers)
  ]
