"""RoPE scalings of Hugging Face checkpoints (llama3, linear, YaRN; LongRoPE has
longrope_test.py): frequencies and attention factors equal transformers', logits and greedy
tokens of scaled checkpoints equal its, saved configs load back the same, and bad parameters
are clear errors."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import torch
import transformers
from helpers import hf_checkpoints as hc

from jaxrl.model import (
  CheckpointError,
  Model,
  ModelConfig,
  config_from_hf,
  load_pretrained,
  save_pretrained,
)
from jaxrl.model.hf_config import check_same_architecture, config_to_hf
from jaxrl.model.rope import rope_attention_factor, rope_inv_freq

torch.set_num_threads(1)

_QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
"""What Qwen3's model card says to add to config.json for 128k contexts."""

# rope_parameters of a Qwen3-shaped config (head_dim 128, 40,960 positions), one per case.
SCALINGS = {
  "llama3": dict(
    rope_type="llama3",
    rope_theta=5e5,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  ),
  "linear": dict(rope_type="linear", rope_theta=1e4, factor=2.0),
  "yarn-qwen3": dict(rope_theta=1e6, **_QWEN3_YARN),
  "yarn-untruncated": dict(
    rope_theta=1e6, **_QWEN3_YARN, truncate=False, beta_fast=16.0, beta_slow=2.0
  ),
  "yarn-mscale": dict(
    rope_type="yarn",
    rope_theta=1e4,
    factor=40.0,
    original_max_position_embeddings=4096,
    mscale=1.0,
    mscale_all_dim=0.707,
  ),
  "yarn-attention-factor": dict(rope_theta=1e6, **_QWEN3_YARN, attention_factor=1.25),
  "yarn-factor-from-lengths": dict(
    rope_type="yarn", rope_theta=1e6, factor=None, original_max_position_embeddings=10240
  ),
}


def _qwen3_shaped(rope_parameters: dict) -> transformers.Qwen3Config:
  return transformers.Qwen3Config(
    vocab_size=100,
    hidden_size=256,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    max_position_embeddings=40960,
    rope_parameters=dict(rope_parameters),
  )


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_and_attention_factor_match_transformers(name):
  config = _qwen3_shaped(SCALINGS[name])
  want, want_scale = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[
    config.rope_parameters["rope_type"]
  ](config)
  cfg = config_from_hf(config.to_dict())
  got = rope_inv_freq(cfg)
  assert got.dtype == np.float32
  # float32 rounding: numpy and torch may round one product of the blend differently.
  np.testing.assert_allclose(got, want.numpy(), rtol=5e-7)
  assert rope_attention_factor(cfg) == pytest.approx(want_scale, rel=1e-12)
  plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=""))
  assert (got < plain).any()  # low frequencies stretched
  if name != "linear":
    assert (got == plain).any()  # high ones kept


def test_yarn_extends_the_context_to_original_times_factor():
  qwen3 = config_from_hf(hc.QWEN3_0_6B | {"rope_scaling": _QWEN3_YARN})
  assert (qwen3.rope_scaling, qwen3.rope_factor, qwen3.max_seq_len) == ("yarn", 4.0, 131072)
  assert qwen3.rope_original_max_position_embeddings == 32768
  # The older spelling of the type key; and a config that already says the longer length.
  legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  assert config_from_hf(hc.QWEN3_0_6B | {"rope_scaling": legacy}) == qwen3
  longer = hc.QWEN3_0_6B | {"rope_scaling": _QWEN3_YARN, "max_position_embeddings": 200_000}
  assert config_from_hf(longer).max_seq_len == 200_000
  # Linear scaling keeps max_position_embeddings.
  linear = {"rope_type": "linear", "factor": 2.0}
  assert config_from_hf(hc.QWEN3_0_6B | {"rope_scaling": linear}).max_seq_len == 40960


def test_a_top_level_original_context_wins_as_in_transformers():
  config = hc.QWEN3_0_6B | {"rope_scaling": _QWEN3_YARN, "original_max_position_embeddings": 4096}
  cfg = config_from_hf(config)
  assert cfg.rope_original_max_position_embeddings == 4096
  want, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](
    transformers.AutoConfig.for_model(**config)
  )
  np.testing.assert_allclose(rope_inv_freq(cfg), want.numpy(), rtol=5e-7)


@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "yarn-factor-from-lengths"])
def test_written_configs_read_back_the_same(name):
  cfg = config_from_hf(_qwen3_shaped(SCALINGS[name]).to_dict())
  written = config_to_hf(cfg, "float32")
  assert config_from_hf(written) == cfg
  # transformers reads the same frequencies from what we wrote.
  hf = transformers.AutoConfig.for_model(**written)
  want, scale = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[cfg.rope_scaling](hf)
  np.testing.assert_allclose(rope_inv_freq(cfg), want.numpy(), rtol=5e-7)
  assert rope_attention_factor(cfg) == pytest.approx(scale, rel=1e-12)


def test_a_source_with_another_scaling_is_another_model():
  cfg = config_from_hf(_qwen3_shaped(SCALINGS["yarn-qwen3"]).to_dict())
  for field, value in [("rope_factor", 2.0), ("rope_beta_fast", 16.0), ("rope_truncate", False)]:
    with pytest.raises(ValueError, match=field):
      check_same_architecture(cfg, dataclasses.replace(cfg, **{field: value}), "src/config.json")


@pytest.mark.parametrize(
  "rope,key",
  [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type"),
    ({"rope_type": "longrope", "factor": 2.0}, r"rope_scaling\.short_factor=None"),
    ({"rope_type": "linear"}, r"rope_scaling\.factor"),
    (_QWEN3_YARN | {"truncate": "yes"}, r"rope_scaling\.truncate"),
    (_QWEN3_YARN | {"factor": "4"}, r"rope_scaling\.factor='4'; expected a number"),
    (_QWEN3_YARN | {"original_max_position_embeddings": 0.5}, "original_max_position"),
    (_QWEN3_YARN | {"factor": 0.5}, "rope_factor"),
    (_QWEN3_YARN | {"beta_fast": 1.0, "beta_slow": 2.0}, "rope_beta_slow"),
    (_QWEN3_YARN | {"attention_factor": 0.0}, r"attention_factor=0\.0; expected > 0"),
  ],
)
def test_bad_scalings_are_clear_errors(rope, key):
  with pytest.raises(CheckpointError, match=rf"config\.json.*{key}"):
    config_from_hf(hc.QWEN3_0_6B | {"rope_scaling": rope})


def test_model_config_checks_the_scaling():
  with pytest.raises(ValueError, match="rope_scaling must be one of"):
    ModelConfig(rope_scaling="dynamic")
  with pytest.raises(ValueError, match="rope_factor must be >= 1 for linear"):
    ModelConfig(rope_scaling="linear", rope_factor=0.5)
  with pytest.raises(ValueError, match="rope_original_max_position_embeddings"):
    ModelConfig(rope_scaling="yarn", rope_original_max_position_embeddings=0)
  with pytest.raises(ValueError, match="rope_attention_factor must be >= 0"):
    ModelConfig(rope_scaling="yarn", rope_attention_factor=-1.0)


# -- checkpoints -------------------------------------------------------------------------------

# Original contexts of 64 positions, so that the scalings act within the tests' 256 tokens.
CHECKPOINTS = {
  "qwen3-yarn": (
    "qwen3",
    dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64),
  ),
  "llama-linear": ("llama", dict(rope_type="linear", rope_theta=1e4, factor=4.0)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  made = {}

  def get(name):
    if name not in made:
      arch, rope = CHECKPOINTS[name]
      directory = tmp_path_factory.mktemp(name)
      made[name] = pathlib.Path(hc.write_checkpoint(directory, arch, rope_parameters=rope))
    return made[name]

  return get


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_scaled_checkpoints_logits_match_transformers(checkpoint, tmp_path, name):
  path = checkpoint(name)
  tokens = np.random.default_rng().integers(0, hc.VOCAB_SIZE, (2, 256)).astype(np.int32)
  want = hc.logits(hc.load_model(path), tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert model.config.rope_scaling == CHECKPOINTS[name][1]["rope_type"]
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4
  # Without the scaling, or under YaRN without its attention factor, the logits are far off.
  wrong = [dataclasses.replace(model.config, rope_scaling="")]
  if name == "qwen3-yarn":
    wrong.append(dataclasses.replace(model.config, rope_attention_factor=1.0))
  for cfg in wrong:
    assert hc.rel_err(hc.jaxrl_logits(Model(cfg), params, tokens), want) > 1e-2
  # Saved without a source, the model loads in transformers with the same logits.
  save_pretrained(model, params, tmp_path / "out")
  reloaded = hc.load_model(tmp_path / "out")
  assert hc.rel_err(hc.logits(reloaded, tokens), want) < 1e-6
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config_from_hf(written) == model.config


def test_paged_greedy_under_yarn_matches_transformers_generate(checkpoint):
  """The decode step rotates q and k in its fused kernel: the attention factor reaches it."""
  path = checkpoint("qwen3-yarn")
  rng = np.random.default_rng()
  prompts = [rng.integers(3, hc.VOCAB_SIZE, n).tolist() for n in (5, 40)]
  want = [hc.greedy(hc.load_model(path), p, 32) for p in prompts]
  assert hc.paged_greedy(path, prompts, 32) == want
