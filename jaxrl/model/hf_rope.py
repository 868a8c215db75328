"""RoPE keys of a Hugging Face config.json <-> `ModelConfig`'s RoPE fields, and the key reading
that `hf_config` shares.

Both layouts the Hub holds are read: the older one (top-level `rope_theta`, a `rope_scaling`
dict) and the one transformers 5 writes (`rope_parameters` with `rope_type` and `rope_theta`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig
from jaxrl.model.rope import yarn_default_attention_factor
from jaxrl.model.safetensors_io import CheckpointError

MISSING = object()


def get_key(config: Mapping[str, Any], key: str, default: Any = MISSING, kind: type = int):
  value = config.get(key, default)
  if value is MISSING:
    raise CheckpointError(f"config.json: key {key!r} is missing; it is required for this model.")
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise CheckpointError(f"config.json: key {key!r} is {value!r}; expected {kind.__name__}.")
  return value


def refuse(config: Mapping[str, Any], key: str, ok, why: str) -> None:
  if key in config and config[key] is not None and not ok(config[key]):
    raise CheckpointError(f"config.json: {key}={config[key]!r} is not supported: {why}.")


def rope_fields(
  config: Mapping[str, Any],
  max_positions: int,
  *,
  theta: float,
  head_dim: int,
  original: int | None = None,
) -> dict[str, Any]:
  """The RoPE fields of ModelConfig, from either config.json layout; `theta` is the model
  type's default base, `head_dim` its heads' width (a partial rotation's share of it becomes
  `rotary_dim`), `original` its default `original_max_position_embeddings` (Phi-3's outranks
  the scaling's own)."""
  # transformers gives a legacy rope_scaling priority over rope_parameters; so do we.
  key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
  params = config.get(key) or {}
  if not isinstance(params, Mapping):
    raise CheckpointError(f"config.json: {key} is {params!r}; expected a dict or null.")
  if any(isinstance(v, Mapping) for v in params.values()):
    raise CheckpointError(
      f"config.json: {key} holds per-layer-type RoPE parameters; jaxrl uses one RoPE for all "
      "layers."
    )
  theta = params.get("rope_theta", config.get("rope_theta", theta))
  theta = get_key({"rope_theta": theta}, "rope_theta", kind=float)
  partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  partial = get_key({"partial_rotary_factor": partial}, "partial_rotary_factor", kind=float)
  rotary_dim = int(head_dim * partial)  # transformers' rounding
  if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
    raise CheckpointError(
      f"config.json: partial_rotary_factor={partial} rotates {rotary_dim} of {head_dim} "
      "dimensions a head; jaxrl needs an even number from 2 to the whole head."
    )
  rope_type = params.get("rope_type", params.get("type", "default"))
  fields = {"rope_theta": theta} | ({"rotary_dim": rotary_dim} if rotary_dim < head_dim else {})
  if rope_type == "default":
    return fields
  if rope_type not in _ROPE_READERS:
    raise CheckpointError(
      f"config.json: {key}.rope_type={rope_type!r} is not supported; jaxrl implements "
      f"{['default', *_ROPE_READERS]} RoPE."
    )
  # transformers takes a top-level original_max_position_embeddings over the scaling's own.
  where = "original_max_position_embeddings"
  original = config.get(where, original)
  if original is None:
    original, where = params.get(where), f"{key}.{where}"
  if original is None:
    original = max_positions
  elif not (isinstance(original, (int, float)) and original == int(original) > 0):
    raise CheckpointError(f"config.json: {where}={original!r}; expected a positive integer.")
  read = _ROPE_READERS[rope_type](params, key, int(original), max_positions)
  if rope_type == "longrope":
    for name in ("rope_short_factor", "rope_long_factor"):
      if len(read[name]) != rotary_dim // 2:
        raise CheckpointError(
          f"config.json: {key}.{name.removeprefix('rope_')} has {len(read[name])} factors; "
          f"longrope needs one per rotated pair, {rotary_dim // 2}."
        )
  return fields | {"rope_scaling": rope_type} | read


def layered_rope(
  config: Mapping[str, Any],
  max_positions: int,
  *,
  head_dim: int,
  local: bool,
  theta: float,
  local_theta: float | None = None,
) -> dict[str, Any]:
  """RoPE that differs by layer type (Gemma 3, OLMo 3): the full-attention layers' (with the
  scaling) as `rope_fields` reads it, and with `local` (the model has sliding layers) the
  sliding layers' plain base, `local_theta` (None: the full layers' base). `theta` is the model
  type's default base. transformers 5 writes `rope_parameters` per layer type."""
  params = config.get("rope_parameters")
  nested = isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values())
  full = config
  if nested and not config.get("rope_scaling"):
    full = {"rope_parameters": params.get("full_attention") or {}}
    sliding = params.get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default":
      raise CheckpointError(
        "config.json: rope_parameters.sliding_attention.rope_type="
        f"{sliding['rope_type']!r} is not supported: jaxrl's sliding layers use plain RoPE."
      )
    local_theta = sliding.get("rope_theta", local_theta)
  rope = rope_fields(full, max_positions, theta=theta, head_dim=head_dim)
  if local:
    local_theta = rope["rope_theta"] if local_theta is None else local_theta
    local_theta = get_key({"rope_local_base_freq": local_theta}, "rope_local_base_freq", kind=float)
    if local_theta <= 0:
      raise CheckpointError(f"config.json: rope_local_base_freq={local_theta}; expected > 0.")
    rope["local_rope_theta"] = local_theta
  return rope


def _number(params: Mapping[str, Any], key: str, name: str, default: Any = MISSING) -> float:
  """`params[name]` as a float; `default` where it is missing or null (required without)."""
  value = params.get(name)
  if value is None:
    if default is MISSING:
      rope_type = params.get("rope_type", params.get("type"))
      raise CheckpointError(f"config.json: {key}.{name} is missing; {rope_type} RoPE needs it.")
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise CheckpointError(f"config.json: {key}.{name}={value!r}; expected a number.")
  return float(value)


def _llama3(params, key: str, original: int, max_positions: int) -> dict[str, Any]:
  return {
    "rope_factor": _number(params, key, "factor"),
    "rope_low_freq_factor": _number(params, key, "low_freq_factor"),
    "rope_high_freq_factor": _number(params, key, "high_freq_factor"),
    "rope_original_max_position_embeddings": original,
  }


def _linear(params, key: str, original: int, max_positions: int) -> dict[str, Any]:
  return {"rope_factor": _number(params, key, "factor")}


def _yarn(params, key: str, original: int, max_positions: int) -> dict[str, Any]:
  """transformers' reading: a missing factor is max_position_embeddings / original; a missing
  attention factor follows from the factor (and DeepSeek's mscale and mscale_all_dim); null or
  zero betas take their defaults."""
  factor = _number(params, key, "factor", max_positions / original)
  attention = _number(params, key, "attention_factor", None)
  if attention is not None and attention <= 0:
    raise CheckpointError(f"config.json: {key}.attention_factor={attention}; expected > 0.")
  mscale = _number(params, key, "mscale", 0.0)
  mscale_all_dim = _number(params, key, "mscale_all_dim", 0.0)
  if attention is None and mscale and mscale_all_dim:
    attention = yarn_default_attention_factor(factor, mscale, mscale_all_dim)
  truncate = params.get("truncate", True)
  if not isinstance(truncate, bool):
    raise CheckpointError(f"config.json: {key}.truncate={truncate!r}; expected true or false.")
  return {
    "rope_factor": factor,
    "rope_original_max_position_embeddings": original,
    "rope_beta_fast": _number(params, key, "beta_fast", 0.0) or 32.0,
    "rope_beta_slow": _number(params, key, "beta_slow", 0.0) or 1.0,
    "rope_attention_factor": attention or 0.0,
    "rope_truncate": truncate,
  }


def _longrope(params, key: str, original: int, max_positions: int) -> dict[str, Any]:
  """transformers' reading: a missing factor is max_position_embeddings / original, from
  which a missing attention factor follows."""
  factors = {}
  for name in ("short_factor", "long_factor"):
    value = params.get(name)
    if not isinstance(value, (list, tuple)) or not all(
      isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value
    ):
      raise CheckpointError(
        f"config.json: {key}.{name}={value!r}; longrope needs a list of numbers > 0."
      )
    factors[f"rope_{name}"] = tuple(float(x) for x in value)
  attention = _number(params, key, "attention_factor", None)
  if attention is not None and attention <= 0:
    raise CheckpointError(f"config.json: {key}.attention_factor={attention}; expected > 0.")
  return factors | {
    "rope_factor": _number(params, key, "factor", max_positions / original),
    "rope_original_max_position_embeddings": original,
    "rope_attention_factor": attention or 0.0,
  }


_ROPE_READERS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope}
"""The RoPE scalings jaxrl implements: rope_type -> reader of its parameters."""

SCALING_FIELDS = {
  "": (),
  "linear": ("rope_factor",),
  "llama3": (
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
  ),
  "yarn": (
    "rope_factor",
    "rope_original_max_position_embeddings",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_attention_factor",
    "rope_truncate",
  ),
  "longrope": (
    "rope_factor",
    "rope_original_max_position_embeddings",
    "rope_attention_factor",
    "rope_short_factor",
    "rope_long_factor",
  ),
}
"""The ModelConfig fields each scaling reads."""


def context_length(rope: Mapping[str, Any], max_positions: int) -> int:
  """The longest sequence a checkpoint is for: `max_position_embeddings`, or under YaRN at
  least the original context times the factor (YaRN's extended context: Qwen3's documented
  setting, factor 4 over 32,768, gives 131,072 where its config.json says 40,960)."""
  if rope.get("rope_scaling") != "yarn":
    return max_positions
  extended = rope["rope_original_max_position_embeddings"] * rope["rope_factor"]
  return max(max_positions, int(extended))


def rope_scaling_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
  if cfg.rope_scaling != "linear":
    out["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
  if cfg.rope_scaling == "llama3":
    out |= {
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
    }
  if cfg.rope_scaling == "longrope":
    out |= {
      "short_factor": list(cfg.rope_short_factor),
      "long_factor": list(cfg.rope_long_factor),
    }
    if cfg.rope_attention_factor:
      out["attention_factor"] = cfg.rope_attention_factor
  if cfg.rope_scaling == "yarn":  # transformers' defaults are left out, as the Hub's files do
    optional = {
      "beta_fast": (cfg.rope_beta_fast, 32.0),
      "beta_slow": (cfg.rope_beta_slow, 1.0),
      "attention_factor": (cfg.rope_attention_factor, 0.0),
      "truncate": (cfg.rope_truncate, True),
    }
    out |= {name: value for name, (value, default) in optional.items() if value != default}
  return out
