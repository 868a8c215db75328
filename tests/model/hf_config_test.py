"""`config_from_hf` on config.json alone (no weights): the Hub's configs give the presets, both
layouts agree, missing keys take transformers' defaults, and a Mistral window caps the length."""

import dataclasses

import pytest
import transformers
from helpers import hf_checkpoints as hc

from jaxrl.model import PRESETS, config_from_hf


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
