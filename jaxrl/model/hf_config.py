"""Hugging Face `config.json` <-> `ModelConfig` for every model type of `ARCHITECTURES`; what
distinguishes each type, and transformers' defaults for it, are in `hf_defaults`.

Both layouts the Hub holds are read: the older one (top-level `rope_theta`, a `rope_scaling`
dict, `torch_dtype`) and the one transformers 5 writes (`rope_parameters` with `rope_type` and
`rope_theta`, `dtype`). Keys a config.json leaves out take transformers' defaults for that model
type. What jaxrl does not implement (biases Llama can switch on, Qwen's sliding windows, dense
layers inside an MoE model, RoPE types other than plain, llama3, linear, yarn and, for Phi-3,
longrope) is refused with the key that asks for it.

Under YaRN (`rope_scaling` of type "yarn", which Qwen2.5 and Qwen3 document for 128k contexts)
`max_seq_len` is at least the original context times the factor, the length YaRN extends to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model import hf_defaults as known
from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_gemma import (
  GEMMA_QUERY_SCALAR,
  GEMMA_TYPES,
  gemma_refusals,
  gemma_rope,
  gemma_softcaps,
  gemma_to_hf,
  language_model_config,
)
from jaxrl.model.hf_gpt_oss import (
  GPT_OSS_FIELDS,
  GPT_OSS_OPTIONS,
  gpt_oss_fields,
  gpt_oss_refusals,
  gpt_oss_to_hf,
  with_default_rope,
)
from jaxrl.model.hf_granite import (
  GRANITE_FIELDS,
  GRANITE_TYPES,
  granite_fields,
  granite_to_hf,
  is_granite,
)
from jaxrl.model.hf_layers import exaone4_nope_layers, layer_windows, nope_layers
from jaxrl.model.hf_rope import (
  MISSING,
  SCALING_FIELDS,
  context_length,
  get_key,
  layered_rope,
  refuse,
  rope_fields,
  rope_scaling_to_hf,
)
from jaxrl.model.safetensors_io import CheckpointError

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "qwen2_moe": "Qwen2MoeForCausalLM",
  "smollm3": "SmolLM3ForCausalLM",
  "olmo2": "Olmo2ForCausalLM",
  "olmo3": "Olmo3ForCausalLM",
  "exaone4": "Exaone4ForCausalLM",
  "glm4": "Glm4ForCausalLM",
  "ernie4_5": "Ernie4_5ForCausalLM",
  "olmoe": "OlmoeForCausalLM",
  "phi3": "Phi3ForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gemma3_text": "Gemma3ForCausalLM",
  "granite": "GraniteForCausalLM",
  "granitemoe": "GraniteMoeForCausalLM",
  "gpt_oss": "GptOssForCausalLM",
  "seed_oss": "SeedOssForCausalLM",
}
"""The model types jaxrl reads and writes, with their transformers architecture."""

ARCH_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "rope_theta",
  "rope_scaling",
  "rotary_dim",
  "norm_eps",
  "qk_norm",
  "qkv_bias",
  "tie_embeddings",
  "num_experts",
  "nope_layers",
  "qk_norm_across_heads",
  "norm_position",
  "attention_logit_softcap",
  "final_logit_softcap",
  "norm_scale_plus_one",
  "mlp_activation",
  "scale_embeddings",
  "attention_logit_scale",
  "sliding_window",
  "sliding_layers",
  "local_rope_theta",
  *GRANITE_FIELDS,
  *GPT_OSS_FIELDS,
)
"""The ModelConfig fields a checkpoint fixes (the rest are runtime choices: dtypes, lengths)."""

_DEFAULTS = ModelConfig()  # the value of each field a model type does not set

_MOE_FIELDS = (
  "experts_per_token",
  "moe_mlp_dim",
  "norm_topk_prob",
  "shared_expert_dim",
  "shared_expert_gate",
)


def _refusals(config: Mapping[str, Any], model_type: str) -> None:
  """Raises for the options of these architectures that jaxrl does not implement."""
  if model_type in GEMMA_TYPES:
    gemma_refusals(config)
    return
  if model_type == "gpt_oss":
    gpt_oss_refusals(config)
    return
  refuse(config, "hidden_act", lambda v: v == "silu", "jaxrl's MLPs use SiLU (SwiGLU)")
  if model_type in ("llama", "smollm3", "granite", "seed_oss"):
    refuse(config, "mlp_bias", lambda v: not v, "jaxrl's MLPs have no biases")
  if model_type == "seed_oss":  # Qwen2's network: q/k/v biases, none on the output
    refuse(config, "attention_bias", lambda v: v, "jaxrl reads Seed-OSS with q/k/v biases")
    refuse(config, "attention_out_bias", lambda v: not v, "jaxrl reads Seed-OSS without one")
  elif model_type == "glm4":
    refuse(config, "attention_bias", lambda v: v, "jaxrl reads GLM-4 with its q/k/v biases")
  elif model_type == "ernie4_5":
    refuse(config, "use_bias", lambda v: not v, "jaxrl reads ERNIE 4.5 without biases")
  elif model_type != "qwen2":  # Qwen2 always has q/k/v biases; the others can turn them on
    refuse(config, "attention_bias", lambda v: not v, "jaxrl has no attention biases here")
  if model_type != "llama":
    refuse(config, "use_sliding_window", lambda v: not v, "jaxrl has no Qwen-style windows")
  if model_type not in ("llama", "olmo3", "exaone4"):  # their layer types are their windows
    refuse(
      config,
      "layer_types",
      lambda v: all(t == "full_attention" for t in v),
      "jaxrl has full attention in every layer",
    )
  if model_type == "mixtral":
    refuse(
      config, "router_jitter_noise", lambda v: v == 0, "jaxrl's router adds no noise in training"
    )
  if model_type == "olmoe":
    refuse(config, "clip_qkv", lambda v: False, "jaxrl does not clip q, k and v")
  if model_type in ("qwen3_moe", "qwen2_moe"):
    refuse(config, "mlp_only_layers", lambda v: not v, "every layer of jaxrl's MoE is sparse")
    refuse(config, "decoder_sparse_step", lambda v: v == 1, "every layer of jaxrl's MoE is sparse")
  if model_type == "qwen2_moe":
    refuse(config, "qkv_bias", lambda v: v, "jaxrl reads Qwen2-MoE with its q/k/v biases")


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
  config = language_model_config(config)
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
  if model_type == "gpt_oss":
    config = with_default_rope(config)
  if model_type == "glm4" and not _names_partial_rotation(config):
    config = {**config, "partial_rotary_factor": known.GLM4_PARTIAL_ROTATION}
  shape = known.SHAPE_DEFAULTS.get(model_type, {})
  d = get_key(config, "hidden_size", shape.get("hidden_size", MISSING))
  heads = get_key(config, "num_attention_heads", shape.get("num_attention_heads", MISSING))
  max_positions = get_key(config, "max_position_embeddings", known.MAX_POSITIONS[model_type])
  num_layers = get_key(config, "num_hidden_layers", shape.get("num_hidden_layers", MISSING))
  windows = layer_windows(config, model_type, num_layers)
  head_dim = config.get("head_dim") or known.HEAD_DIM.get(model_type, d // max(heads, 1))
  head_dim = get_key({"head_dim": head_dim}, "head_dim")
  # A scaling's original context defaults to the full one.
  local = bool(windows.get("sliding_layers"))
  if model_type == "gemma3_text":
    rope = gemma_rope(config, max_positions, head_dim=head_dim, local=local)
  elif model_type == "olmo3":  # the scaling in full layers only
    # Olmo3Config gives the sliding layers its default base unless `rope_parameters` name
    # theirs: a top-level `rope_theta` goes to the full layers alone.
    theta = known.ROPE_THETA["olmo3"]
    rope = layered_rope(
      config, max_positions, head_dim=head_dim, local=local, theta=theta, local_theta=theta
    )
  else:
    rope = rope_fields(
      config,
      max_positions,
      theta=known.ROPE_THETA.get(model_type, 1e4),
      head_dim=head_dim,
      original=known.PHI3_ORIGINAL if model_type == "phi3" else None,
    )
  # A partial rotation needs the architecture to rotate only part of each head (transformers'
  # Phi-3 and GLM-4 do; its others rotate the whole head whatever the config says).
  if "rotary_dim" in rope and model_type not in ("phi3", "glm4"):
    raise CheckpointError(
      f"config.json: partial_rotary_factor rotates {rope['rotary_dim']} of {head_dim} "
      f"dimensions a head, which {model_type} does not: jaxrl reads a partial rotation for "
      "phi3 (Phi-3.5, Phi-4-mini) and glm4 only."
    )
  if rope.get("rope_scaling") == "longrope" and model_type != "phi3":
    raise CheckpointError(
      f"config.json: longrope RoPE is not supported for {model_type}: jaxrl reads it for phi3 "
      "(Phi-3.5, Phi-4-mini) only."
    )
  max_positions = context_length(rope, max_positions)
  kv_heads = config.get("num_key_value_heads") or known.KV_HEADS.get(model_type, heads)
  fields = dict(
    vocab_size=get_key(config, "vocab_size", shape.get("vocab_size", MISSING)),
    d_model=d,
    num_layers=num_layers,
    num_heads=heads,
    num_kv_heads=get_key({"num_key_value_heads": kv_heads}, "num_key_value_heads"),
    head_dim=head_dim,
    mlp_dim=get_key(
      config,
      "intermediate_size",
      known.MOE_DEFAULTS.get(model_type, shape).get("intermediate_size", MISSING),
    ),
    max_seq_len=max_positions,
    norm_eps=get_key(config, "rms_norm_eps", known.NORM_EPS.get(model_type, 1e-6), float),
    **_layer_options(model_type),
    tie_embeddings=get_key(config, "tie_word_embeddings", model_type in known.TIED, bool),
    **rope,
    **windows,
  )
  if model_type in GEMMA_TYPES:
    fields |= gemma_softcaps(config, model_type)
    scalar = get_key(config, "query_pre_attn_scalar", GEMMA_QUERY_SCALAR, float)
    if scalar <= 0:
      raise CheckpointError(f"config.json: query_pre_attn_scalar={scalar}; expected > 0.")
    if scalar != fields["head_dim"]:  # else the default, head_dim ** -0.5
      fields["attention_logit_scale"] = scalar**-0.5
  if model_type in GRANITE_TYPES:
    fields |= granite_fields(config, head_dim)
  if model_type == "gpt_oss":
    fields |= gpt_oss_fields(config)
  if model_type == "smollm3":
    fields["nope_layers"] = nope_layers(config, fields["num_layers"])
  if model_type == "exaone4" and windows:  # a hybrid model's global layers have no RoPE
    fields["nope_layers"] = exaone4_nope_layers(fields["num_layers"], windows["sliding_layers"])
  elif model_type == "exaone4" and config.get(
    "sliding_window", known.LAYERED_WINDOWS["exaone4"][0]
  ):
    raise CheckpointError(
      "config.json: a sliding_window without a sliding layer (layer_types) leaves every EXAONE "
      "4 layer without RoPE, which jaxrl does not implement; set sliding_window to null."
    )
  if model_type in known.MOE_DEFAULTS:
    moe = known.MOE_DEFAULTS[model_type]
    experts = {config.get(k) for k in ("num_experts", "num_local_experts")} - {None}
    if len(experts) > 1:
      raise CheckpointError(
        f"config.json: num_experts and num_local_experts disagree ({sorted(experts)})."
      )
    num_experts = experts.pop() if experts else moe["num_experts"]
    get_key({"num_experts": num_experts}, "num_experts")
    if num_experts < 1:
      raise CheckpointError(f"config.json: num_experts={num_experts}: an MoE needs experts.")
    fields |= dict(
      num_experts=num_experts,
      experts_per_token=get_key(config, "num_experts_per_tok", moe["num_experts_per_tok"]),
      moe_mlp_dim=fields["mlp_dim"]
      if "moe_intermediate_size" not in moe
      else get_key(config, "moe_intermediate_size", moe["moe_intermediate_size"]),
      norm_topk_prob=(
        model_type in known.ALWAYS_NORM_TOPK or get_key(config, "norm_topk_prob", False, bool)
      ),
    )
    if model_type == "qwen2_moe":  # a gated shared expert in every layer
      shared = get_key(
        config, "shared_expert_intermediate_size", moe["shared_expert_intermediate_size"]
      )
      if shared < 1:
        raise CheckpointError(
          f"config.json: shared_expert_intermediate_size={shared}; expected >= 1."
        )
      fields |= dict(shared_expert_dim=shared, shared_expert_gate=True)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise CheckpointError(f"config.json: gives an invalid model: {e}") from None


def _names_partial_rotation(config: Mapping[str, Any]) -> bool:
  params = [config] + [config.get(k) or {} for k in ("rope_scaling", "rope_parameters")]
  return any("partial_rotary_factor" in p for p in params if isinstance(p, Mapping))


def _layer_options(model_type: str) -> dict[str, Any]:
  """The ModelConfig options a model type fixes in every layer: q/k norms, norm position and
  style, q/k/v biases, MLP activation, embedding scale."""
  gemma = model_type in GEMMA_TYPES
  options = dict(
    qk_norm=model_type in known.QK_NORM,
    qk_norm_across_heads=known.QK_NORM.get(model_type) == "across",
    norm_position="post"
    if model_type in ("olmo2", "olmo3", "exaone4")
    else "sandwich"
    if gemma or model_type == "glm4"
    else "pre",
    qkv_bias=model_type in ("qwen2", "qwen2_moe", "seed_oss", "glm4"),
    norm_scale_plus_one=gemma,
    mlp_activation="gelu_tanh" if gemma else "silu",
    scale_embeddings=gemma,
    attention_out_bias=False,
    attention_sinks=False,
  )
  return options | GPT_OSS_OPTIONS if model_type == "gpt_oss" else options


def model_type_of(cfg: ModelConfig) -> str:
  """The Hugging Face model type that holds `cfg`: MoE -> olmoe with q/k norms across heads,
  qwen3_moe with per-head ones, mixtral without; sandwich norms -> gemma3_text, post-norm ->
  olmo2, q/k norm -> qwen3, q/k/v bias -> qwen2, NoPE layers -> smollm3, a sliding window in
  every layer -> mistral, Granite's multipliers -> granite, else llama; a partial rotation or
  longrope RoPE -> phi3 (on what would be llama or mistral).

  Raises:
    ValueError: a combination none of them has (an MoE without q/k norm, q/k norm with biases
      or NoPE layers, ...), naming the field to change.
  """
  if cfg.is_moe and cfg.moe_biases:
    model_type = "gpt_oss"
  elif cfg.is_moe and cfg.qkv_bias:
    model_type = "qwen2_moe"
  elif cfg.is_moe and not cfg.qk_norm:  # Granite's multipliers or none: Mixtral's network
    model_type = "granitemoe" if is_granite(cfg) else "mixtral"
  elif cfg.is_moe:
    model_type = "olmoe" if cfg.qk_norm_across_heads else "qwen3_moe"
  elif cfg.norm_position == "sandwich" and not cfg.norm_scale_plus_one:
    model_type = "glm4"
  elif cfg.norm_position == "sandwich":
    model_type = "gemma3_text" if cfg.qk_norm else "gemma2"
  elif cfg.norm_position == "post" and cfg.qk_norm and not cfg.qk_norm_across_heads:
    model_type = "exaone4"
  elif cfg.norm_position == "post":
    model_type = "olmo3" if cfg.sliding_layers else "olmo2"
  elif cfg.qk_norm:
    model_type = "qwen3"
  elif cfg.qkv_bias:
    model_type = "qwen2"
  elif cfg.nope_layers:
    model_type = "smollm3"
  elif cfg.sliding_layers:
    model_type = "mistral"
  elif is_granite(cfg):
    model_type = "granite"
  else:
    model_type = "llama"
  if (cfg.rotary_dim or cfg.rope_scaling == "longrope") and model_type != "glm4":
    if model_type not in ("llama", "mistral"):
      raise ValueError(
        f"No Hugging Face architecture has this model: a partial rotation (model.rotary_dim) "
        f"or longrope RoPE is Phi-3's, Llama's network, not {model_type}'s."
      )
    model_type = "phi3"
  for name, value in _layer_options(model_type).items():
    if getattr(cfg, name) != value:
      raise ValueError(
        f"No Hugging Face architecture has this model: {model_type} needs model.{name}={value!r}."
      )
  if model_type in known.ALWAYS_NORM_TOPK and not cfg.norm_topk_prob:
    raise ValueError(
      f"No Hugging Face architecture has this model: {model_type}'s router weights are its "
      f"top-k probabilities renormalised: {model_type} needs model.norm_topk_prob=True."
    )
  if model_type == "exaone4" and cfg.nope_layers != exaone4_nope_layers(
    cfg.num_layers, cfg.sliding_layers
  ):
    raise ValueError(
      "No Hugging Face architecture has this model: EXAONE 4 rotates every layer of a model "
      "without windows and, with windows, only the sliding ones: exaone4 needs "
      f"model.nope_layers={exaone4_nope_layers(cfg.num_layers, cfg.sliding_layers)}."
    )
  if cfg.nope_layers and model_type not in ("smollm3", "exaone4"):
    raise ValueError(
      f"No Hugging Face architecture has this model: {model_type} rotates every layer, "
      f"model.nope_layers={cfg.nope_layers} (only SmolLM3 has NoPE layers, with neither q/k "
      "norm nor biases)."
    )
  everywhere = cfg.sliding_layers == tuple(range(cfg.num_layers))
  if cfg.sliding_layers and not (
    model_type in (*GEMMA_TYPES, "gpt_oss", "olmo3", "exaone4")
    or (model_type in ("mistral", "mixtral", "phi3") and everywhere)
  ):
    raise ValueError(
      f"No Hugging Face architecture has this model: {model_type} has no sliding window in "
      f"model.sliding_layers={cfg.sliding_layers} (Mistral and Mixtral window every layer, "
      "Gemma 3, gpt-oss, OLMo 3 and EXAONE 4 any)."
    )
  gemma_only = ("attention_logit_scale", "attention_logit_softcap", "final_logit_softcap")
  only = {"local_rope_theta": ("gemma3_text", "olmo3")} | dict.fromkeys(gemma_only, GEMMA_TYPES)
  only |= dict.fromkeys(GRANITE_FIELDS, GRANITE_TYPES)
  only |= {"swiglu_alpha": ("gpt_oss",), "swiglu_limit": ("gpt_oss",)}
  only |= {"shared_expert_dim": ("qwen2_moe",), "shared_expert_gate": ("qwen2_moe",)}
  only["attention_logit_scale"] = (*GEMMA_TYPES, *GRANITE_TYPES)
  for name, types in only.items():
    default = getattr(_DEFAULTS, name)
    if getattr(cfg, name) != default and model_type not in types:
      who = types[0] if len(types) == 1 else f"{', '.join(types[:-1])} and {types[-1]}"
      raise ValueError(
        f"No Hugging Face architecture has this model: {model_type} needs "
        f"model.{name}={default} (only {who} set it)."
      )
  if model_type == "qwen2_moe" and not (cfg.shared_expert_dim and cfg.shared_expert_gate):
    raise ValueError(
      "No Hugging Face architecture has this model: an MoE with q/k/v biases is Qwen2-MoE, "
      "which has a gated shared expert: model.shared_expert_dim > 0, shared_expert_gate=True."
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
    out["rope_scaling"] = rope_scaling_to_hf(cfg)
  if model_type not in ("qwen2", "qwen2_moe", "gpt_oss"):
    out["attention_bias"] = model_type == "glm4"
  if model_type in ("llama", "smollm3", "granite"):
    out["mlp_bias"] = False
  if model_type not in (
    "llama",
    "olmo2",
    "olmo3",
    "exaone4",
    "glm4",
    "olmoe",
    "mixtral",
    "gpt_oss",
    *GEMMA_TYPES,
    *GRANITE_TYPES,
  ):
    out["use_sliding_window"] = False
  if model_type == "smollm3":
    out["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]
  if cfg.is_moe:
    local = ("mixtral", "gpt_oss", "granitemoe")
    experts = "num_local_experts" if model_type in local else "num_experts"
    out |= {experts: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token}
    if "moe_intermediate_size" in known.MOE_DEFAULTS[model_type]:
      out["moe_intermediate_size"] = cfg.moe_mlp_dim
    else:  # intermediate_size is one expert's width
      out["intermediate_size"] = cfg.moe_mlp_dim
    if model_type not in known.ALWAYS_NORM_TOPK:
      out["norm_topk_prob"] = cfg.norm_topk_prob
  if model_type in ("mistral", "mixtral", "phi3"):
    out["sliding_window"] = cfg.sliding_window or None
  if model_type == "glm4":  # without it, GLM-4 rotates half of each head
    out["partial_rotary_factor"] = partial_rotary_factor(cfg) if cfg.rotary_dim else 1.0
  if model_type == "phi3":  # Phi-3 reads these at the top level
    if cfg.rotary_dim:
      out["partial_rotary_factor"] = partial_rotary_factor(cfg)
    if cfg.rope_scaling:
      out["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
  if model_type == "mixtral":
    out["router_jitter_noise"] = 0.0
  if model_type in GEMMA_TYPES:
    gemma_to_hf(cfg, out)
  if model_type == "exaone4":
    out["sliding_window"] = cfg.sliding_window or None
    out["layer_types"] = [
      "sliding_attention" if i in cfg.sliding_layers else "full_attention"
      for i in range(cfg.num_layers)
    ]
  if model_type == "olmo3":  # RoPE per layer type: transformers 5's layout
    out["sliding_window"] = cfg.sliding_window
    out["layer_types"] = [
      "sliding_attention" if i in cfg.sliding_layers else "full_attention"
      for i in range(cfg.num_layers)
    ]
    theta, scaling = out.pop("rope_theta"), out.pop("rope_scaling", {})
    out["rope_parameters"] = {
      "full_attention": {"rope_type": "default", "rope_theta": theta} | scaling,
      "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta or theta},
    }
  if model_type in GRANITE_TYPES:
    granite_to_hf(cfg, out)
  if model_type == "gpt_oss":
    gpt_oss_to_hf(cfg, out)
  if model_type == "olmoe":
    out["clip_qkv"] = None
  if model_type in ("qwen3_moe", "qwen2_moe"):
    out |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
  if model_type == "qwen2_moe":
    out |= {"qkv_bias": True, "shared_expert_intermediate_size": cfg.shared_expert_dim}
  return out


def partial_rotary_factor(cfg: ModelConfig) -> float:
  """The `partial_rotary_factor` from which transformers' `int(head_dim * factor)` gives
  `cfg.rotary_dim`."""
  factor = cfg.rotary_dim / cfg.head_dim
  return (
    factor
    if int(cfg.head_dim * factor) == cfg.rotary_dim
    else (cfg.rotary_dim + 0.5) / cfg.head_dim
  )


def check_same_architecture(cfg: ModelConfig, source: ModelConfig, where: str) -> None:
  """Raises ValueError naming the first field a checkpoint fixes where `cfg` and `source`
  differ (`where` names the source's config.json)."""
  names = list(ARCH_FIELDS)
  if not cfg.is_moe:
    names.append("mlp_dim")
  names += SCALING_FIELDS[cfg.rope_scaling]
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
  """A copy of a config.json dict that says its tensors are `dtype`, in the layout it uses,
  and unquantised (jaxrl writes no quantized tensors: gpt-oss's MXFP4 experts are saved in
  `dtype`)."""
  out = dict(config)
  out.pop("quantization_config", None)
  keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
  for key in keys:
    out[key] = dtype
  return out
