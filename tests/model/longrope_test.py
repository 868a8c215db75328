"""Phi-3.5 and Phi-4-mini RoPE: LongRoPE's short and long factors and a partial rotation
(`ModelConfig.rotary_dim`). Frequencies equal transformers'; a tiny Phi-3 checkpoint with both
gives transformers' logits within the original context and, past it, the greedy tokens of
transformers' model stepped with its cache (`rope.py` says where its `generate` differs); it
saves and loads back."""

import copy
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
from jaxrl.model.rope import partial_rotary_order, rope_attention_factor, rope_inv_freq

torch.set_num_threads(1)

# Phi-4-mini's shapes (head_dim 128, 96 rotated) and the form of its rope_scaling.
_PHI4_MINI = {
  "model_type": "phi3",
  "architectures": ["Phi3ForCausalLM"],
  "vocab_size": 200064,
  "hidden_size": 3072,
  "intermediate_size": 8192,
  "num_hidden_layers": 32,
  "num_attention_heads": 24,
  "num_key_value_heads": 8,
  "max_position_embeddings": 131072,
  "original_max_position_embeddings": 4096,
  "partial_rotary_factor": 0.75,
  "rope_theta": 10000.0,
  "rope_scaling": {
    "type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(48)],
    "long_factor": [1.0 + 1.5 * i for i in range(48)],
  },
  "sliding_window": 262144,
  "tie_word_embeddings": True,
}


def test_phi4_mini_frequencies_and_attention_factor_match_transformers():
  cfg = config_from_hf(_PHI4_MINI)
  assert (cfg.rotary_dim, cfg.rope_scaling, cfg.max_seq_len) == (96, "longrope", 131072)
  assert cfg.rope_original_max_position_embeddings == 4096 and cfg.rope_factor == 32.0
  hf = transformers.AutoConfig.for_model(**copy.deepcopy(_PHI4_MINI))  # it edits rope_scaling
  init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
  short, scale = init(hf)
  long, _ = init(hf, seq_len=4097)
  for got, want in ((rope_inv_freq(cfg), short), (rope_inv_freq(cfg, long=True), long)):
    np.testing.assert_allclose(got[:48], want.numpy(), rtol=5e-7)
    assert not got[48:].any() and got.shape == (64,)  # 16 pairs unrotated: frequency 0
  assert rope_attention_factor(cfg) == pytest.approx(scale, rel=1e-12)
  assert scale == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)


def test_partial_rotary_order_pairs_the_rotated_dimensions_a_half_head_apart():
  order = partial_rotary_order(8, 4)  # rotated: pairs (0, 2), (1, 3); unrotated 4..7
  np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
  assert [(order[i], order[i + 4]) for i in range(2)] == [(0, 2), (1, 3)]
  assert partial_rotary_order(8, 8) is None and partial_rotary_order(8, 0) is None


@pytest.mark.parametrize(
  "change,error",
  [
    ({"partial_rotary_factor": 0.3046875}, "partial_rotary_factor=0.3046875 rotates 39 of 128"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     r"short_factor has 1 factors; longrope needs one per rotated pair, 48"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}, r"long_factor=None"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [0.0] * 48, "long_factor": [1] * 48}},
     "short_factor=.*numbers > 0"),
    ({"model_type": "llama", "architectures": None}, "rotates 96 of 128 .* which llama does not"),
    ({"model_type": "glm4", "architectures": None}, "longrope RoPE is not supported for glm4"),
  ],
)  # fmt: skip
def test_bad_longrope_configs_are_clear_errors(change, error):
  with pytest.raises(CheckpointError, match=rf"config\.json.*{error}"):
    config_from_hf(_PHI4_MINI | change)


def test_model_config_checks_longrope_and_the_rotary_width():
  with pytest.raises(ValueError, match="rotary_dim must be 0"):
    ModelConfig(rotary_dim=7)
  with pytest.raises(ValueError, match="rope_short_factor must hold 16 factors"):
    ModelConfig(rope_scaling="longrope", rope_long_factor=(1.0,) * 16)


# A tiny Phi-3 with Phi-4-mini's RoPE: half of each 16-wide head rotated, an original context
# of 32 positions extended 4x, long factors far from the short ones.
ORIGINAL = 32
ROPE = dict(
  rope_type="longrope",
  rope_theta=1e4,
  partial_rotary_factor=0.5,
  short_factor=[1.0 + 0.1 * i for i in range(4)],
  long_factor=[2.0 + 3.0 * i for i in range(4)],
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("phi-longrope")
  return pathlib.Path(
    hc.write_checkpoint(
      directory, "phi3", rope_parameters=ROPE, original_max_position_embeddings=ORIGINAL,
      max_position_embeddings=4 * ORIGINAL,
    )
  )  # fmt: skip


def test_logits_within_the_original_context_match_transformers(checkpoint, tmp_path):
  config = json.loads((checkpoint / "config.json").read_text())
  assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
  tokens = np.random.default_rng().integers(0, hc.VOCAB_SIZE, (2, ORIGINAL)).astype(np.int32)
  want = hc.logits(hc.load_model(checkpoint), tokens)
  model, params = load_pretrained(checkpoint, dtype="float32")
  assert (model.config.rotary_dim, model.config.rope_scaling) == (8, "longrope")
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4
  # Without the attention factor, or with other short factors, the logits are far off.
  for wrong in ({"rope_attention_factor": 1.0}, {"rope_short_factor": tuple(ROPE["long_factor"])}):
    cfg = dataclasses.replace(model.config, **wrong)
    assert hc.rel_err(hc.jaxrl_logits(Model(cfg), params, tokens), want) > 1e-2
  # Saved without a source: a Phi-3 config transformers reads with the same logits.
  save_pretrained(model, params, tmp_path / "out")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["Phi3ForCausalLM"]
  assert config_from_hf(written) == model.config
  assert hc.rel_err(hc.logits(hc.load_model(tmp_path / "out"), tokens), want) < 1e-6


def _stepped_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
  """transformers' greedy continuation with its cache, one token a step: every key keeps the
  rotation of its position. (Its `generate` for Phi-3 instead drops the cache when the
  sequence first passes the original context and recomputes it all with the long factors.)"""
  tokens = []
  with torch.no_grad():
    out = model(torch.tensor([prompt]), use_cache=True)
    for i in range(max_new_tokens):
      tokens.append(int(out.logits[0, -1].argmax()))
      position = torch.tensor([[len(prompt) + i]])
      out = model(
        torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, position_ids=position
      )
  return tokens


def test_greedy_tokens_past_the_original_context_match_transformers_stepped(checkpoint):
  """Prompts within the original context, continued 40 tokens past it: the paged engine's
  decode steps rotate with the long factors from position 32 on, as transformers' rotary
  embedding does for those positions."""
  rng = np.random.default_rng()
  prompts = [rng.integers(3, hc.VOCAB_SIZE, n).tolist() for n in (5, 30)]
  hf = hc.load_model(checkpoint)
  want = [_stepped_greedy(hf, p, 40) for p in prompts]
  assert hc.paged_greedy(checkpoint, prompts, 40) == want
  # With the short factors throughout, the tokens past the original context are others.
  short_only = transformers.AutoConfig.from_pretrained(checkpoint)
  short_only.rope_parameters["long_factor"] = list(ROPE["short_factor"])
  hf_short = transformers.AutoModelForCausalLM.from_pretrained(
    checkpoint, config=short_only, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert [_stepped_greedy(hf_short, p, 40) for p in prompts] != want
