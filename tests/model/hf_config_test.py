"""`config_from_hf` on config.json alone (no weights): the Hub's configs give the presets, both
layouts agree, missing keys take transformers' defaults, a Mistral window slides in every layer, and
SmolLM3's NoPE layers read and write."""

import dataclasses

import pytest
import transformers
from helpers import hf_checkpoints as hc

from jaxrl.model import PRESETS, CheckpointError, ModelConfig, config_from_hf
from jaxrl.model.hf_config import config_to_hf, model_type_of


@pytest.mark.parametrize(
  "hub,preset", [(hc.QWEN3_0_6B, "qwen3-0.6b"), (hc.QWEN3_30B_A3B, "qwen3-30b-a3b")]
)
def test_hub_configs_give_the_presets(hub, preset):
  got = config_from_hf(hub)
  assert dataclasses.replace(got, dtype="bfloat16", param_dtype="bfloat16") == PRESETS[preset]


def _new_layout(old: dict) -> dict:
  """The layout transformers 5 writes: rope_parameters and dtype."""
  new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  new["rope_parameters"] = dict(old.get("rope_scaling") or {"rope_type": "default"})
  new["rope_parameters"]["rope_theta"] = old["rope_theta"]
  new["dtype"] = old["torch_dtype"]
  return new


@pytest.mark.parametrize(
  "hub", [hc.QWEN3_0_6B, hc.QWEN3_30B_A3B, hc.LLAMA_3_2_1B], ids=lambda h: h["model_type"]
)
def test_old_and_new_config_layouts_agree(hub):
  old = config_from_hf(hub)
  assert config_from_hf(_new_layout(hub)) == old
  # The older spelling of the scaling's type key, too.
  if hub.get("rope_scaling"):
    legacy = hub | {"rope_scaling": hub["rope_scaling"] | {"type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert config_from_hf(legacy) == old
    assert (old.rope_scaling, old.rope_factor, old.rope_theta) == ("llama3", 32.0, 500000.0)
  # And transformers' own round trip of it.
  hf = transformers.AutoConfig.for_model(**hub)
  assert config_from_hf(hf.to_dict()) == old


@pytest.mark.parametrize("arch", hc.ARCHS)
def test_missing_keys_take_transformers_defaults(arch):
  core = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
  )
  full = transformers.AutoConfig.for_model(arch, **core).to_dict()
  assert config_from_hf({"model_type": arch, **core}) == config_from_hf(full)


def test_a_mistral_window_slides_in_every_layer():
  """Mistral's window applies to every layer (transformers' default window where config.json
  has no key); the sequence length stays max_position_embeddings; a null window is Llama."""
  core = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
  core |= dict(num_key_value_heads=2)
  config = {"model_type": "mistral", "vocab_size": 100, "max_position_embeddings": 8192, **core}
  default = config_from_hf(config)
  assert (default.sliding_window, default.sliding_layers, default.max_seq_len) == (
    4096,
    (0, 1),
    8192,
  )
  windowed = config_from_hf(config | {"sliding_window": 1000})
  assert (windowed.sliding_window, windowed.max_seq_len) == (1000, 8192)
  assert model_type_of(windowed) == "mistral"
  assert config_to_hf(windowed, "float32")["sliding_window"] == 1000
  unwindowed = config_from_hf(config | {"sliding_window": None})
  assert (unwindowed.sliding_layers, model_type_of(unwindowed)) == ((), "llama")


def test_smollm3_nope_layers():
  """SmolLM3: no RoPE where no_rope_layers says 0; without the key, every fourth layer (as
  transformers fills it in); written back as SmolLM3, or as Llama with no NoPE layer."""
  core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4)
  hf = transformers.SmolLM3Config(**core, num_hidden_layers=8)
  cfg = config_from_hf(hf.to_dict())
  assert cfg.nope_layers == (3, 7) and cfg.tie_embeddings and cfg.rope_theta == 2e6
  assert config_from_hf({"model_type": "smollm3", "num_hidden_layers": 8, **core}) == cfg
  written = config_to_hf(cfg, "bfloat16")
  assert written["architectures"] == ["SmolLM3ForCausalLM"] and config_from_hf(written) == cfg
  assert transformers.AutoConfig.for_model(**written).no_rope_layers == hf.no_rope_layers
  listed = hf.to_dict() | {"no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 1, 1]}  # longer is allowed
  assert config_from_hf(listed).nope_layers == (0,)
  every_layer = config_from_hf(hf.to_dict() | {"no_rope_layers": [1] * 8})
  assert every_layer.nope_layers == () and model_type_of(every_layer) == "llama"


@pytest.mark.parametrize(
  "change",
  [{"no_rope_layers": [1, 0]}, {"no_rope_layers": [1, 2] * 4}, {"no_rope_layer_interval": 0}],
)
def test_bad_nope_layers_are_clear_errors(change):
  config = {"model_type": "smollm3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 8}
  config |= {"intermediate_size": 96, "num_attention_heads": 4} | change
  with pytest.raises(CheckpointError, match=rf"config\.json: {next(iter(change))}="):
    config_from_hf(config)


def test_nope_layers_only_in_a_model_smollm3_holds():
  with pytest.raises(ValueError, match="nope_layers must be increasing layer indices"):
    ModelConfig(num_layers=2, nope_layers=(2,))
  with pytest.raises(ValueError, match="only SmolLM3 has NoPE layers"):
    model_type_of(ModelConfig(num_layers=2, nope_layers=(1,), qk_norm=True))


def test_olmo2_options_only_together():
  """Post-norm is OLMo 2's, which also norms q and k across heads, or EXAONE 4's, which norms
  them per head: a post-norm model without q/k norms, or q/k norms across heads without
  post-norm, has no Hugging Face architecture."""
  olmo2 = ModelConfig(norm_position="post", qk_norm=True, qk_norm_across_heads=True)
  assert model_type_of(olmo2) == "olmo2"
  assert model_type_of(ModelConfig(norm_position="post", qk_norm=True)) == "exaone4"
  with pytest.raises(ValueError, match="olmo2 needs model.qk_norm=True"):
    model_type_of(ModelConfig(norm_position="post"))
  with pytest.raises(ValueError, match="qwen3 needs model.qk_norm_across_heads=False"):
    model_type_of(ModelConfig(qk_norm=True, qk_norm_across_heads=True))
  with pytest.raises(ValueError, match="norm_position must be one of"):
    ModelConfig(norm_position="middle")
  with pytest.raises(ValueError, match="qk_norm_across_heads=True needs model.qk_norm=True"):
    ModelConfig(qk_norm_across_heads=True)


def test_a_phi3_window_slides_in_every_layer():
  """Phi-3-mini-4k's config says sliding_window 2047: read like Mistral's, but Phi-3 has no
  window by default."""
  core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
  config = {"model_type": "phi3", "num_attention_heads": 4, "max_position_embeddings": 4096}
  config |= core
  assert config_from_hf(config).sliding_layers == ()
  windowed = config_from_hf(config | {"sliding_window": 2047})
  assert (windowed.sliding_window, windowed.sliding_layers, windowed.max_seq_len) == (
    2047,
    (0, 1),
    4096,
  )
  assert model_type_of(config_from_hf(config)) == "llama"  # the same network
  assert model_type_of(windowed) == "mistral"


# Gemma 3 1B's config.json as the Hub publishes it (the older layout), abridged.
GEMMA_3_1B = {
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": False,
  "attn_logit_softcapping": None,
  "final_logit_softcapping": None,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": None,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "vocab_size": 262144,
}


def test_gemma3_1b_hub_config():
  """Five sliding layers in six (the pattern), their own RoPE base, the logit scale left at
  head_dim ** -0.5 where query_pre_attn_scalar is head_dim; the same as transformers 5's own
  layout (rope_parameters per layer type, layer_types) and written back to it."""
  cfg = config_from_hf(GEMMA_3_1B)
  assert cfg.sliding_window == 512 and cfg.local_rope_theta == 10_000.0
  assert cfg.sliding_layers == tuple(i for i in range(26) if (i + 1) % 6)
  assert (cfg.rope_theta, cfg.rope_scaling, cfg.attention_logit_scale) == (1e6, "", 0.0)
  assert (cfg.norm_position, cfg.mlp_activation, cfg.tie_embeddings) == (
    "sandwich",
    "gelu_tanh",
    True,
  )
  assert cfg.norm_scale_plus_one and cfg.scale_embeddings and cfg.qk_norm
  assert model_type_of(cfg) == "gemma3_text"
  assert config_from_hf(config_to_hf(cfg, "bfloat16")) == cfg
  bf16 = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
  assert bf16 == PRESETS["gemma3-1b"] and cfg.num_params() == 999_885_952  # transformers' count
  v5 = transformers.Gemma3TextConfig(**GEMMA_3_1B).to_dict()
  assert "rope_parameters" in v5 and "rope_theta" not in v5
  assert config_from_hf(v5) == cfg
  # Gemma 3 27B: query_pre_attn_scalar 168 with head_dim 128; 4B and up: linear scaling by 8.
  big = config_from_hf(
    GEMMA_3_1B
    | {"query_pre_attn_scalar": 168, "head_dim": 128}
    | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
  )
  assert big.attention_logit_scale == 168**-0.5 and big.rope_factor == 8.0
  assert config_from_hf(config_to_hf(big, "bfloat16")) == big
  capped = config_from_hf(GEMMA_3_1B | {"attn_logit_softcapping": 50.0})  # Gemma 3 may set it
  assert capped.attention_logit_softcap == 50.0 and model_type_of(capped) == "gemma3_text"


@pytest.mark.parametrize(
  "change,key",
  [
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
  ],
)
def test_gemma3_refusals_name_the_key(change, key):
  with pytest.raises(CheckpointError, match=key):
    config_from_hf(GEMMA_3_1B | change)


def test_windows_only_where_an_architecture_has_them():
  qwen3 = ModelConfig(qk_norm=True, num_layers=2, sliding_window=8, sliding_layers=(0, 1))
  with pytest.raises(ValueError, match="qwen3 has no sliding window"):
    model_type_of(qwen3)
  some = ModelConfig(num_layers=2, sliding_window=8, sliding_layers=(1,))
  with pytest.raises(ValueError, match="mistral has no sliding window"):
    model_type_of(some)
  with pytest.raises(ValueError, match="give a window >= 1 and the layers"):
    ModelConfig(sliding_window=8)
  with pytest.raises(ValueError, match="local_rope_theta"):
    ModelConfig(local_rope_theta=10.0)


def test_mixtral_always_renormalises_its_router_weights():
  """transformers' Mixtral reads no norm_topk_prob key: its router always renormalises."""
  core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
  config = {"model_type": "mixtral", "num_attention_heads": 8, **core}
  assert config_from_hf(config).norm_topk_prob
  assert config_from_hf(config | {"norm_topk_prob": False}).norm_topk_prob
  assert model_type_of(config_from_hf(config)) == "mixtral"


# Gemma 2 2B's config.json as the Hub publishes it, abridged.
GEMMA_2_2B = {
  "architectures": ["Gemma2ForCausalLM"],
  "attention_bias": False,
  "attn_logit_softcapping": 50.0,
  "final_logit_softcapping": 30.0,
  "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "max_position_embeddings": 8192,
  "model_type": "gemma2",
  "num_attention_heads": 8,
  "num_hidden_layers": 26,
  "num_key_value_heads": 4,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "torch_dtype": "float32",
  "vocab_size": 256000,
}


def test_gemma2_2b_hub_config():
  """Every other layer sliding (the first), both softcaps, no q/k norm, one RoPE; written back
  the same; softcaps default to Gemma 2's where the keys are missing and turn off with null."""
  cfg = config_from_hf(GEMMA_2_2B)
  assert cfg.sliding_layers == tuple(range(0, 26, 2)) and cfg.sliding_window == 4096
  assert (cfg.attention_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
  assert not cfg.qk_norm and cfg.local_rope_theta == 0 and cfg.norm_position == "sandwich"
  assert model_type_of(cfg) == "gemma2"
  assert config_from_hf(config_to_hf(cfg, "bfloat16")) == cfg
  assert config_from_hf(transformers.Gemma2Config(**GEMMA_2_2B).to_dict()) == cfg
  assert cfg.num_params() == 2_614_341_888  # transformers' count
  missing = {k: v for k, v in GEMMA_2_2B.items() if not k.endswith("softcapping")}
  assert config_from_hf(missing) == cfg
  off = config_from_hf(GEMMA_2_2B | {"attn_logit_softcapping": None})
  assert off.attention_logit_softcap == 0 and off.final_logit_softcap == 30.0
  with pytest.raises(CheckpointError, match="final_logit_softcapping"):
    config_from_hf(GEMMA_2_2B | {"final_logit_softcapping": -1.0})
  with pytest.raises(ValueError, match="only gemma2 and gemma3_text set it"):
    model_type_of(ModelConfig(final_logit_softcap=30.0))


# Granite 3.3 2B Instruct's config.json (ibm-granite/granite-3.3-2b-instruct), its shapes and
# scalars; the keys transformers' defaults give are left out.
GRANITE_3_3_2B = {
  "architectures": ["GraniteForCausalLM"],
  "model_type": "granite",
  "vocab_size": 49159,
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "num_hidden_layers": 40,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "max_position_embeddings": 131072,
  "rope_theta": 10000000.0,
  "rms_norm_eps": 1e-05,
  "tie_word_embeddings": True,
  "attention_multiplier": 0.015625,
  "embedding_multiplier": 12.0,
  "logits_scaling": 8.0,
  "residual_multiplier": 0.22,
}


def test_granite_config_reads_its_scalars_and_writes_them_back():
  cfg = config_from_hf(GRANITE_3_3_2B)
  assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (12, 0.22, 8)
  assert cfg.attention_logit_scale == 0.015625 and cfg.head_dim == 64
  assert model_type_of(cfg) == "granite"
  assert config_from_hf(config_to_hf(cfg, "bfloat16")) == cfg
  # An attention multiplier of head_dim ** -0.5 is the default scale.
  plain = config_from_hf(GRANITE_3_3_2B | {"attention_multiplier": 0.125})
  assert plain.attention_logit_scale == 0
  with pytest.raises(CheckpointError, match=r"config\.json: logits_scaling=0\.0; expected > 0"):
    config_from_hf(GRANITE_3_3_2B | {"logits_scaling": 0.0})
  with pytest.raises(
    ValueError, match=r"qwen3 needs model\.embedding_multiplier=1\.0 \(only granite"
  ):
    model_type_of(dataclasses.replace(plain, qk_norm=True))


def test_olmo3_sliding_layers_take_transformers_bases_in_either_layout():
  """OLMo 3's scaling applies to its full layers only. In the older layout a top-level
  rope_theta is the full layers' alone: transformers gives the sliding layers Olmo3Config's
  default base (500,000), and so does jaxrl; `rope_parameters` per layer type name both."""
  old = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 1e4,
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
  }  # fmt: skip
  cfg = config_from_hf(old)
  assert cfg.sliding_layers == (0, 1, 2) and cfg.sliding_window == 4096  # one full in four
  theirs = transformers.Olmo3Config(**{k: v for k, v in old.items() if k != "architectures"})
  assert cfg.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 5e5
  assert (cfg.rope_theta, cfg.rope_scaling) == (1e4, "yarn")
  written = config_to_hf(cfg, "float32")
  assert written["rope_parameters"]["sliding_attention"] == {
    "rope_type": "default",
    "rope_theta": 5e5,
  }
  assert config_from_hf(written) == cfg
  assert model_type_of(cfg) == "olmo3"
  assert model_type_of(dataclasses.replace(cfg, sliding_window=0, sliding_layers=(),
                                           local_rope_theta=0.0)) == "olmo2"  # fmt: skip


def test_exaone4_windows_and_nope_layers_follow_its_pattern():
  """EXAONE 4: an int pattern (one global layer in that many, as Exaone4Config lays them out),
  a string one ("LLLG", the Hub's 32B), or no window at all (every layer rotated); the global
  layers of a windowed model have no RoPE."""
  base = {
    "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4096,
  }  # fmt: skip
  theirs = transformers.Exaone4Config(**{k: v for k, v in base.items() if k != "architectures"})
  want = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
  for cfg in (config_from_hf(base), config_from_hf(base | {"sliding_window_pattern": "LLLG"})):
    assert cfg.sliding_layers == want == (0, 1, 2, 4, 5, 6) and cfg.nope_layers == (3, 7)
    assert (cfg.qk_norm, cfg.qk_norm_across_heads, cfg.norm_position) == (True, False, "post")
    assert model_type_of(cfg) == "exaone4" and config_from_hf(config_to_hf(cfg, "float32")) == cfg
  plain = config_from_hf(base | {"sliding_window": None})
  assert plain.sliding_layers == () and plain.nope_layers == ()
  assert config_from_hf(config_to_hf(plain, "float32")) == plain
  with pytest.raises(CheckpointError, match="sliding_window_pattern"):
    config_from_hf(base | {"sliding_window_pattern": "LLXG"})
  with pytest.raises(ValueError, match="exaone4 needs model.nope_layers"):
    model_type_of(dataclasses.replace(plain, nope_layers=(1,)))


def test_glm4_rotating_whole_heads_saves_and_reads_back_whole():
  """GLM-4 rotates half of each head unless config.json says otherwise, so a model rotating
  whole heads is written with `partial_rotary_factor` 1.0 (it was left out: read back, the
  model rotated half)."""
  whole = config_from_hf(
    hc.hf_config("glm4", rope_parameters={"partial_rotary_factor": 1.0}).to_dict()
  )
  assert whole.rotary_dim == 0
  written = config_to_hf(whole, "float32")
  assert written["partial_rotary_factor"] == 1.0
  assert config_from_hf(written) == whole
  half = config_from_hf(hc.hf_config("glm4").to_dict())
  assert half.rotary_dim == half.head_dim // 2
  assert config_from_hf(config_to_hf(half, "float32")) == half


def test_a_partial_rotation_with_a_scaling_reads_for_glm4_only():
  """A partial rotation goes with any RoPE scaling on GLM-4 (as on Phi-3); another
  architecture rotates whole heads, so asking it for part is refused, naming the key."""
  yarn = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64)
  cfg = config_from_hf(
    hc.hf_config("glm4", rope_parameters=yarn | {"partial_rotary_factor": 0.5}).to_dict()
  )
  assert (cfg.rope_scaling, cfg.rotary_dim) == ("yarn", cfg.head_dim // 2)
  llama = hc.hf_config("llama", rope_parameters=yarn | {"partial_rotary_factor": 0.5}).to_dict()
  with pytest.raises(
    CheckpointError, match="partial_rotary_factor rotates 16 of 32 .* which llama does not"
  ):
    config_from_hf(llama)
