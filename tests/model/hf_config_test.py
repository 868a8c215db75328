"""`config_from_hf` on config.json alone (no weights): the Hub's configs give the presets, both
layouts agree, missing keys take transformers' defaults, a Mistral window caps the length, and
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


def test_a_mistral_window_caps_the_sequence_length():
  """Up to its window, sliding attention is full attention: the model reads with max_seq_len
  at most the window (transformers' default window where config.json has no key)."""
  core = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
  core |= dict(num_key_value_heads=2)
  config = {"model_type": "mistral", "vocab_size": 100, "max_position_embeddings": 8192, **core}
  assert config_from_hf(config).max_seq_len == 4096
  assert config_from_hf(config | {"sliding_window": 1000}).max_seq_len == 1000
  assert config_from_hf(config | {"sliding_window": 9000}).max_seq_len == 8192
  assert config_from_hf(config | {"sliding_window": None}).max_seq_len == 8192


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
  """Post-norm is OLMo 2's, which also norms q and k across heads: a model with one but not
  the other has no Hugging Face architecture."""
  olmo2 = ModelConfig(norm_position="post", qk_norm=True, qk_norm_across_heads=True)
  assert model_type_of(olmo2) == "olmo2"
  with pytest.raises(ValueError, match="olmo2 needs model.qk_norm_across_heads=True"):
    model_type_of(ModelConfig(norm_position="post", qk_norm=True))
  with pytest.raises(ValueError, match="qwen3 needs model.qk_norm_across_heads=False"):
    model_type_of(ModelConfig(qk_norm=True, qk_norm_across_heads=True))
  with pytest.raises(ValueError, match="norm_position must be one of"):
    ModelConfig(norm_position="sandwich")
  with pytest.raises(ValueError, match="qk_norm_across_heads=True needs model.qk_norm=True"):
    ModelConfig(qk_norm_across_heads=True)


def test_a_phi3_window_caps_the_sequence_length():
  """Phi-3-mini-4k's config says sliding_window 2047: read like Mistral's, but Phi-3 has no
  window by default."""
  core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
  config = {"model_type": "phi3", "num_attention_heads": 4, "max_position_embeddings": 4096}
  config |= core
  assert config_from_hf(config).max_seq_len == 4096
  assert config_from_hf(config | {"sliding_window": 2047}).max_seq_len == 2047
  assert model_type_of(config_from_hf(config)) == "llama"  # the same network


def test_mixtral_always_renormalises_its_router_weights():
  """transformers' Mixtral reads no norm_topk_prob key: its router always renormalises."""
  core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
  config = {"model_type": "mixtral", "num_attention_heads": 8, **core}
  assert config_from_hf(config).norm_topk_prob
  assert config_from_hf(config | {"norm_topk_prob": False}).norm_topk_prob
  assert model_type_of(config_from_hf(config)) == "mixtral"
