"""Hugging Face `config.json` <-> `ModelConfig` for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
SmolLM3, OLMo 2, OLMoE, Phi-3 and Mixtral.

Both layouts the Hub holds are read: the older one (top-level `rope_theta`, a `rope_scaling`
dict, `torch_dtype`) and the one transformers 5 writes (`rope_parameters` with `rope_type` and
`rope_theta`, `dtype`). Keys a config.json leaves out take transformers' defaults for that model
type. What jaxrl does not implement (biases Llama can switch on, sliding windows, dense layers
inside an MoE model, RoPE types other than plain, llama3, linear and yarn) is refused with the
key that asks for it.

Under YaRN (`rope_scaling` of type "yarn", which Qwen2.5 and Qwen3 document for 128k contexts)
`max_seq_len` is at least the original context times the factor, the length YaRN extends to.

Mistral is Llama's network with a sliding attention window (`sliding_window`: each position
attends to at most that many, itself included). Up to that many positions, that is full
attention, so a Mistral checkpoint reads with `max_seq_len` capped at its window (a run that
asks for longer sequences gets the window: `PretrainedConfig.path`); a model saved without its
source checkpoint is written as Llama, the same network.

SmolLM3 is Llama's network with no RoPE in some layers (`no_rope_layers`: 1 rotates, 0 does
not; by default every fourth layer is NoPE): `ModelConfig.nope_layers`. OLMo 2 norms each
sublayer's output rather than its input (`norm_position="post"`) and each token's q and k
projections across all heads (`qk_norm_across_heads`); OLMoE is a pre-norm MoE with those q/k
norms (its `intermediate_size` is one expert's width). Phi-3 (Phi-3, Phi-4) is Llama's network
with fused q/k/v and gate/up tensors (`hf_layout`) and, in some, a sliding window (which caps
`max_seq_len` as Mistral's does); saved without its source it is written as Llama. Mixtral is
Mistral's network with MoE MLPs (top-k router weights always renormalised, no q/k norms).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig
from jaxrl.model.rope import yarn_default_attention_factor
from jaxrl.model.safetensors_io import CheckpointError

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "smollm3": "SmolLM3ForCausalLM",
  "olmo2": "Olmo2ForCausalLM",
  "olmoe": "OlmoeForCausalLM",
  "phi3": "Phi3ForCausalLM",
  "mixtral": "MixtralForCausalLM",
}
"""The model types jaxrl reads and writes, with their transformers architecture."""

# transformers 5's defaults for keys a config.json may leave out (the model classes' fields).
_MAX_POSITIONS = {
  "llama": 2048,
  "mistral": 131072,
  "qwen2": 32768,
  "qwen3": 32768,
  "qwen3_moe": 32768,
  "smollm3": 32768,
  "olmo2": 2048,
  "olmoe": 4096,
  "phi3": 4096,
  "mixtral": 131072,
}
_NORM_EPS = {"olmo2": 1e-5, "olmoe": 1e-5, "phi3": 1e-5, "mixtral": 1e-5}  # others: 1e-6
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmo2": "across", "olmoe": "across"}
"""Model types with q/k norms: per head, or across all heads of a token (OLMo's)."""
# transformers' num_key_value_heads where config.json has none (others: num_attention_heads).
_KV_HEADS = {"mistral": 8, "mixtral": 8, "qwen2": 32, "qwen3": 32, "qwen3_moe": 4, "smollm3": 4}
# Model types with a sliding window (which caps max_seq_len), and transformers' default for it.
_WINDOW = {"mistral": 4096, "phi3": None, "mixtral": None}
_HEAD_DIM = {"qwen3": 128}  # others: hidden_size // num_attention_heads
_ROPE_THETA = {"smollm3": 2_000_000.0, "mixtral": 1_000_000.0}  # others: 10,000
_PHI3_ORIGINAL = 4096  # Phi3Config's original_max_position_embeddings, which outranks the scaling's
_TIED = {"smollm3"}  # model types whose tie_word_embeddings defaults to true
_NOPE_INTERVAL = 4  # SmolLM3: without no_rope_layers, every fourth layer is NoPE
# MoE model types: transformers' defaults. One expert's width is `moe_intermediate_size` where
# the type has that key, else `intermediate_size` itself.
_MOE_DEFAULTS = {
  "qwen3_moe": {
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
  },
  "olmoe": {"num_experts_per_tok": 8, "num_experts": 64, "intermediate_size": 2048},
  "mixtral": {"num_experts_per_tok": 2, "num_experts": 8, "intermediate_size": 14336},
}
# Model types whose router always renormalises its top-k weights (transformers' Mixtral reads
# no norm_topk_prob key); the others read it, default false.
_ALWAYS_NORM_TOPK = {"mixtral"}

ARCH_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "rope_theta",
  "rope_scaling",
  "norm_eps",
  "qk_norm",
  "qkv_bias",
  "tie_embeddings",
  "num_experts",
  "nope_layers",
  "qk_norm_across_heads",
  "norm_position",
)
"""The ModelConfig fields a checkpoint fixes (the rest are runtime choices: dtypes, lengths)."""

_MOE_FIELDS = ("experts_per_token", "moe_mlp_dim", "norm_topk_prob")

_MISSING = object()


def _get(config: Mapping[str, Any], key: str, default: Any = _MISSING, kind: type = int):
  value = config.get(key, default)
  if value is _MISSING:
    raise CheckpointError(f"config.json: key {key!r} is missing; it is required for this model.")
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise CheckpointError(f"config.json: key {key!r} is {value!r}; expected {kind.__name__}.")
  return value


def _refuse(config: Mapping[str, Any], key: str, ok, why: str) -> None:
  if key in config and config[key] is not None and not ok(config[key]):
    raise CheckpointError(f"config.json: {key}={config[key]!r} is not supported: {why}.")


def _rope(config: Mapping[str, Any], model_type: str, max_positions: int) -> dict[str, Any]:
  """The RoPE fields of ModelConfig, from either config.json layout."""
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
  theta = params.get("rope_theta", config.get("rope_theta", _ROPE_THETA.get(model_type, 1e4)))
  theta = _get({"rope_theta": theta}, "rope_theta", kind=float)
  partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise CheckpointError(
      "config.json: partial_rotary_factor != 1 is not supported: jaxrl rotates whole heads."
    )
  rope_type = params.get("rope_type", params.get("type", "default"))
  fields = {"rope_theta": theta}
  if rope_type == "default":
    return fields
  if rope_type not in _ROPE_READERS:
    raise CheckpointError(
      f"config.json: {key}.rope_type={rope_type!r} is not supported; jaxrl implements "
      f"{['default', *_ROPE_READERS]} RoPE."
    )
  # transformers takes a top-level original_max_position_embeddings over the scaling's own.
  where = "original_max_position_embeddings"
  original = config.get(where, _PHI3_ORIGINAL if model_type == "phi3" else None)
  if original is None:
    original, where = params.get(where), f"{key}.{where}"
  if original is None:
    original = max_positions
  elif not (isinstance(original, (int, float)) and original == int(original) > 0):
    raise CheckpointError(f"config.json: {where}={original!r}; expected a positive integer.")
  readers = _ROPE_READERS[rope_type]
  return fields | {"rope_scaling": rope_type} | readers(params, key, int(original), max_positions)


def _number(params: Mapping[str, Any], key: str, name: str, default: Any = _MISSING) -> float:
  """`params[name]` as a float; `default` where it is missing or null (required without)."""
  value = params.get(name)
  if value is None:
    if default is _MISSING:
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


_ROPE_READERS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}
"""The RoPE scalings jaxrl implements: rope_type -> reader of its parameters."""

_SCALING_FIELDS = {
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
}
"""The ModelConfig fields each scaling reads."""


def _context_length(rope: Mapping[str, Any], max_positions: int) -> int:
  """The longest sequence a checkpoint is for: `max_position_embeddings`, or under YaRN at
  least the original context times the factor (YaRN's extended context: Qwen3's documented
  setting, factor 4 over 32,768, gives 131,072 where its config.json says 40,960)."""
  if rope.get("rope_scaling") != "yarn":
    return max_positions
  extended = rope["rope_original_max_position_embeddings"] * rope["rope_factor"]
  return max(max_positions, int(extended))


def _refusals(config: Mapping[str, Any], model_type: str) -> None:
  """Raises for the options of these architectures that jaxrl does not implement."""
  _refuse(config, "hidden_act", lambda v: v == "silu", "jaxrl's MLPs use SiLU (SwiGLU)")
  if model_type in ("llama", "smollm3"):
    _refuse(config, "mlp_bias", lambda v: not v, "jaxrl's MLPs have no biases")
  if model_type != "qwen2":  # Qwen2 always has q/k/v biases; the others can turn them on
    _refuse(config, "attention_bias", lambda v: not v, "jaxrl has no attention biases here")
  if model_type != "llama":
    _refuse(config, "use_sliding_window", lambda v: not v, "jaxrl attends over the whole window")
    _refuse(
      config,
      "layer_types",
      lambda v: all(t == "full_attention" for t in v),
      "jaxrl has full attention in every layer",
    )
  if model_type == "mixtral":
    _refuse(
      config, "router_jitter_noise", lambda v: v == 0, "jaxrl's router adds no noise in training"
    )
  if model_type == "olmoe":
    _refuse(config, "clip_qkv", lambda v: False, "jaxrl does not clip q, k and v")
  if model_type == "qwen3_moe":
    _refuse(config, "mlp_only_layers", lambda v: not v, "every layer of jaxrl's MoE is sparse")
    _refuse(config, "decoder_sparse_step", lambda v: v == 1, "every layer of jaxrl's MoE is sparse")


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
  """The ModelConfig of a Hugging Face config.json (as a dict).

  The dtypes are left at ModelConfig's defaults (the caller chooses them, e.g.
  `load_pretrained(dtype=...)`); `max_seq_len` is `max_position_embeddings` (for Mistral, at
  most its `sliding_window`).

  Raises:
    CheckpointError: an unknown model_type, architectures that disagree with it, a missing or
      mistyped key, or an option jaxrl does not implement; the message names config.json and
      the key.
  """
  model_type = config.get("model_type")
  if model_type not in ARCHITECTURES:
    raise CheckpointError(
      f"config.json: model_type={model_type!r} is not supported; jaxrl reads "
      f"{sorted(ARCHITECTURES)}."
    )
  archs = config.get("architectures")
  if archs is not None and list(archs) != [ARCHITECTURES[model_type]]:
    raise CheckpointError(
      f"config.json: architectures={archs!r} does not match model_type={model_type!r}; "
      f"jaxrl reads {ARCHITECTURES[model_type]} for it."
    )
  _refusals(config, model_type)
  d, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
  max_positions = _get(config, "max_position_embeddings", _MAX_POSITIONS[model_type])
  # A scaling's original context defaults to the full one.
  rope = _rope(config, model_type, max_positions)
  max_positions = _context_length(rope, max_positions)
  if model_type in _WINDOW:
    window = config.get("sliding_window", _WINDOW[model_type])
    if window is not None:
      window = _get({"sliding_window": window}, "sliding_window")
      if window < 1:
        raise CheckpointError(f"config.json: sliding_window={window}; expected null or >= 1.")
      max_positions = min(max_positions, window)
  head_dim = config.get("head_dim") or _HEAD_DIM.get(model_type, d // max(heads, 1))
  kv_heads = config.get("num_key_value_heads") or _KV_HEADS.get(model_type, heads)
  fields = dict(
    vocab_size=_get(config, "vocab_size"),
    d_model=d,
    num_layers=_get(config, "num_hidden_layers"),
    num_heads=heads,
    num_kv_heads=_get({"num_key_value_heads": kv_heads}, "num_key_value_heads"),
    head_dim=_get({"head_dim": head_dim}, "head_dim"),
    mlp_dim=_get(
      config,
      "intermediate_size",
      _MOE_DEFAULTS.get(model_type, {}).get("intermediate_size", _MISSING),
    ),
    max_seq_len=max_positions,
    norm_eps=_get(config, "rms_norm_eps", _NORM_EPS.get(model_type, 1e-6), float),
    **_layer_options(model_type),
    tie_embeddings=_get(config, "tie_word_embeddings", model_type in _TIED, bool),
    **rope,
  )
  if model_type == "smollm3":
    fields["nope_layers"] = _nope_layers(config, fields["num_layers"])
  if model_type in _MOE_DEFAULTS:
    defaults = _MOE_DEFAULTS[model_type]
    experts = {config.get(k) for k in ("num_experts", "num_local_experts")} - {None}
    if len(experts) > 1:
      raise CheckpointError(
        f"config.json: num_experts and num_local_experts disagree ({sorted(experts)})."
      )
    num_experts = experts.pop() if experts else defaults["num_experts"]
    _get({"num_experts": num_experts}, "num_experts")
    if num_experts < 1:
      raise CheckpointError(f"config.json: num_experts={num_experts}: an MoE needs experts.")
    fields |= dict(
      num_experts=num_experts,
      experts_per_token=_get(config, "num_experts_per_tok", defaults["num_experts_per_tok"]),
      moe_mlp_dim=fields["mlp_dim"]
      if "moe_intermediate_size" not in defaults
      else _get(config, "moe_intermediate_size", defaults["moe_intermediate_size"]),
      norm_topk_prob=model_type in _ALWAYS_NORM_TOPK or _get(config, "norm_topk_prob", False, bool),
    )
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise CheckpointError(f"config.json: gives an invalid model: {e}") from None


def _layer_options(model_type: str) -> dict[str, Any]:
  """The ModelConfig options a model type fixes in every layer: q/k norms, norm position,
  q/k/v biases."""
  return dict(
    qk_norm=model_type in _QK_NORM,
    qk_norm_across_heads=_QK_NORM.get(model_type) == "across",
    norm_position="post" if model_type == "olmo2" else "pre",
    qkv_bias=model_type == "qwen2",
  )


def _nope_layers(config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
  """SmolLM3's layers without RoPE: where `no_rope_layers` (a 1 or 0 per layer) says 0, or
  without it every `no_rope_layer_interval`-th layer."""
  flags = config.get("no_rope_layers")
  if flags is None:
    interval = _get(config, "no_rope_layer_interval", _NOPE_INTERVAL)
    if interval < 1:
      raise CheckpointError(f"config.json: no_rope_layer_interval={interval}; expected >= 1.")
    flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
  if (
    not isinstance(flags, list)
    or len(flags) < num_layers
    or any(isinstance(f, bool) or f not in (0, 1) for f in flags)
  ):
    raise CheckpointError(
      f"config.json: no_rope_layers={flags!r}; expected a list of 1 (RoPE) or 0 (none) for "
      f"each of the num_hidden_layers={num_layers} layers."
    )
  return tuple(i for i in range(num_layers) if not flags[i])


def model_type_of(cfg: ModelConfig) -> str:
  """The Hugging Face model type that holds `cfg`: MoE -> olmoe with q/k norms across heads,
  qwen3_moe with per-head ones, mixtral without; post-norm -> olmo2, q/k norm -> qwen3, q/k/v
  bias -> qwen2, NoPE layers -> smollm3, else llama.

  Raises:
    ValueError: a combination none of them has (an MoE without q/k norm, q/k norm with biases
      or NoPE layers, ...), naming the field to change.
  """
  if cfg.is_moe:
    model_type = "olmoe" if cfg.qk_norm_across_heads else "qwen3_moe" if cfg.qk_norm else "mixtral"
  elif cfg.norm_position == "post":
    model_type = "olmo2"
  elif cfg.qk_norm:
    model_type = "qwen3"
  elif cfg.qkv_bias:
    model_type = "qwen2"
  elif cfg.nope_layers:
    model_type = "smollm3"
  else:
    model_type = "llama"
  for name, value in _layer_options(model_type).items():
    if getattr(cfg, name) != value:
      raise ValueError(
        f"No Hugging Face architecture has this model: {model_type} needs model.{name}={value!r}."
      )
  if model_type == "mixtral" and not cfg.norm_topk_prob:
    raise ValueError(
      "No Hugging Face architecture has this model: an MoE without q/k norms is Mixtral, which "
      "renormalises its top-k router weights: mixtral needs model.norm_topk_prob=True."
    )
  if cfg.nope_layers and model_type != "smollm3":
    raise ValueError(
      f"No Hugging Face architecture has this model: {model_type} rotates every layer, "
      f"model.nope_layers={cfg.nope_layers} (only SmolLM3 has NoPE layers, with neither q/k "
      "norm nor biases)."
    )
  return model_type


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  """A config.json for `cfg` whose tensors are stored in `dtype`.

  Written in the older layout (top-level `rope_theta`, `rope_scaling`, `torch_dtype`), which
  transformers 4 and 5 and vLLM all read; transformers 5 converts it on load.
  """
  model_type = model_type_of(cfg)
  out: dict[str, Any] = {
    "architectures": [ARCHITECTURES[model_type]],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "tie_word_embeddings": cfg.tie_embeddings,
    "torch_dtype": dtype,
    "use_cache": True,
    # Unknown here (the tokenizer's; `save_pretrained(token_ids=...)` fills them): null, so
    # that transformers does not take its class defaults, another tokenizer's ids.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
  }
  if cfg.rope_scaling:
    out["rope_scaling"] = _rope_scaling_to_hf(cfg)
  if model_type != "qwen2":
    out["attention_bias"] = False
  if model_type in ("llama", "smollm3"):
    out["mlp_bias"] = False
  if model_type not in ("llama", "olmo2", "olmoe", "mixtral"):
    out["use_sliding_window"] = False
  if model_type == "smollm3":
    out["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]
  if cfg.is_moe:
    experts = "num_local_experts" if model_type == "mixtral" else "num_experts"
    out |= {experts: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token}
    if "moe_intermediate_size" in _MOE_DEFAULTS[model_type]:
      out["moe_intermediate_size"] = cfg.moe_mlp_dim
    else:  # intermediate_size is one expert's width
      out["intermediate_size"] = cfg.moe_mlp_dim
    if model_type not in _ALWAYS_NORM_TOPK:
      out["norm_topk_prob"] = cfg.norm_topk_prob
  if model_type == "mixtral":
    out |= {"sliding_window": None, "router_jitter_noise": 0.0}
  if model_type == "olmoe":
    out["clip_qkv"] = None
  if model_type == "qwen3_moe":
    out |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
  return out


def _rope_scaling_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
  if cfg.rope_scaling != "linear":
    out["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
  if cfg.rope_scaling == "llama3":
    out |= {
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
    }
  if cfg.rope_scaling == "yarn":  # transformers' defaults are left out, as the Hub's files do
    optional = {
      "beta_fast": (cfg.rope_beta_fast, 32.0),
      "beta_slow": (cfg.rope_beta_slow, 1.0),
      "attention_factor": (cfg.rope_attention_factor, 0.0),
      "truncate": (cfg.rope_truncate, True),
    }
    out |= {name: value for name, (value, default) in optional.items() if value != default}
  return out


def check_same_architecture(cfg: ModelConfig, source: ModelConfig, where: str) -> None:
  """Raises ValueError naming the first field a checkpoint fixes where `cfg` and `source`
  differ (`where` names the source's config.json)."""
  names = list(ARCH_FIELDS)
  if not cfg.is_moe:
    names.append("mlp_dim")
  names += _SCALING_FIELDS[cfg.rope_scaling]
  if cfg.is_moe:
    names += _MOE_FIELDS
  for name in names:
    if getattr(cfg, name) != getattr(source, name):
      raise ValueError(
        f"{where} describes another model: its {name} is {getattr(source, name)!r}, the model's "
        f"is {getattr(cfg, name)!r}. Pass the source the model was loaded from, or source=None "
        "to write a config.json from the model's config."
      )


def with_dtype(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
  """A copy of a config.json dict that says its tensors are `dtype`, in the layout it uses."""
  out = dict(config)
  keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
  for key in keys:
    out[key] = dtype
  return out
