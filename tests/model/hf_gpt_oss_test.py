"""gpt-oss checkpoints as OpenAI released them, with MXFP4 experts: the dequantisation against
transformers' own, a tiny MXFP4 checkpoint's logits against transformers' model holding the
experts transformers dequantises, a save from it (unquantised, without the quantization
config) that transformers loads, and gpt-oss-20b's config. (The unquantised layout's logits,
greedy generation and saving: `hf_test.py`, "gpt_oss".)
"""

import json

import numpy as np
import pytest
import torch
from helpers import hf_checkpoints as hc
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxrl.model import config_from_hf, get_preset, load_pretrained, mxfp4, save_pretrained
from jaxrl.model.safetensors_io import CheckpointError

# The quantization config of OpenAI's gpt-oss checkpoints.
QUANTIZATION = {
  "modules_to_not_convert": [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
  ],
  "quant_method": "mxfp4",
}
PROJECTIONS = ("gate_up_proj", "down_proj")


def test_dequantize_matches_transformers():
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # every code, both nibbles
  scales = rng.integers(100, 140, (3, 40, 4), dtype=np.uint8)
  ours = mxfp4.dequantize(blocks, scales, np.float32)
  theirs = convert_moe_packed_tensors(
    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
  )
  assert ours.shape == (3, 128, 40)
  np.testing.assert_array_equal(ours, theirs.numpy())
  with pytest.raises(ValueError, match="do not match"):
    mxfp4.dequantize(blocks, scales[:, :39], np.float32)


def test_quantize_rounds_to_the_nearest_fp4_value_of_each_groups_scale():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((2, 64, 24)).astype(np.float32)
  back = mxfp4.dequantize(*mxfp4.quantize(w), np.float32)
  # FP4's grid is at most 2 (between 4 and 6) of a group's scale apart, the scale at most
  # top / 3 (the largest value lands in (3, 6]): within top / 3 of each weight.
  top = np.abs(w).reshape(2, 2, 32, 24).max(axis=2, keepdims=True)
  bound = np.broadcast_to(top / 3, (2, 2, 32, 24)).reshape(w.shape)
  assert np.all(np.abs(back - w) <= bound + 1e-7)
  assert np.mean(np.abs(back - w)) < 0.1
  np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(back), np.float32), back)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
  """A tiny gpt-oss checkpoint with its experts in MXFP4, as OpenAI's; the transformers model
  with the experts transformers dequantises from it; and the one it was quantised from."""
  path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
  hc.write_checkpoint(path, "gpt_oss")
  tensors = load_file(path / "model.safetensors")
  original, reference = hc.load_model(path), hc.load_model(path)
  for name in list(tensors):
    if name.rsplit(".", 1)[-1] in PROJECTIONS:
      blocks, scales = mxfp4.quantize(tensors.pop(name))
      tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
      layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
      theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales))
      experts = reference.model.layers[layer].mlp.experts
      with torch.no_grad():
        getattr(experts, proj).copy_(theirs.float())
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION}))
  return path, reference, original


def test_mxfp4_experts_load_as_transformers_dequantises_them(mxfp4_checkpoint):
  path, reference, original = mxfp4_checkpoint
  tokens = np.random.default_rng(2).integers(3, hc.VOCAB_SIZE, (2, 96))
  want = hc.logits(reference, tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4
  # The quantisation moved the logits far past that: the dequantised experts are what is read.
  assert hc.rel_err(hc.logits(original, tokens), want) > 1e-2


def test_a_save_from_mxfp4_writes_unquantised_experts(mxfp4_checkpoint, tmp_path):
  """...that transformers loads: the same logits as the model it was read into."""
  path, reference, _ = mxfp4_checkpoint
  model, params = load_pretrained(path, dtype="float32")
  save_pretrained(model, params, tmp_path / "out", source=path)
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert "quantization_config" not in config
  assert config_from_hf(config) == model.config
  names = load_file(tmp_path / "out" / "model.safetensors").keys()
  assert "model.layers.0.mlp.experts.gate_up_proj" in names
  assert not [n for n in names if n.endswith(("_blocks", "_scales"))]
  tokens = np.random.default_rng(3).integers(3, hc.VOCAB_SIZE, (2, 64))
  reloaded = hc.load_model(tmp_path / "out")
  assert hc.rel_err(hc.logits(reloaded, tokens), hc.logits(reference, tokens)) < 1e-5


def test_a_truncated_mxfp4_tensor_names_itself(mxfp4_checkpoint, tmp_path):
  path, *_ = mxfp4_checkpoint
  tensors = load_file(path / "model.safetensors")
  name = "model.layers.1.mlp.experts.down_proj_scales"
  tensors[name] = tensors[name][:, :, :0]
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match=name):
    load_pretrained(tmp_path, dtype="float32")


# gpt-oss-20b's config.json: its keys and shapes (24 layers of 32 experts, every other layer
# windowed, MXFP4 experts).
GPT_OSS_20B = {
  "architectures": ["GptOssForCausalLM"],
  "attention_bias": True,
  "attention_dropout": 0.0,
  "eos_token_id": 200002,
  "experts_per_token": 4,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2880,
  "initial_context_length": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": ["sliding_attention", "full_attention"] * 12,
  "max_position_embeddings": 131072,
  "model_type": "gpt_oss",
  "num_attention_heads": 64,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 8,
  "num_local_experts": 32,
  "output_router_logits": False,
  "pad_token_id": 199999,
  "quantization_config": QUANTIZATION,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": False,
  },
  "rope_theta": 150000,
  "router_aux_loss_coef": 0.9,
  "sliding_window": 128,
  "swiglu_limit": 7.0,
  "tie_word_embeddings": False,
  "torch_dtype": "bfloat16",
  "use_cache": True,
  "vocab_size": 201088,
}


def test_gpt_oss_20b_config_is_the_preset():
  cfg = config_from_hf(GPT_OSS_20B)
  assert cfg == get_preset("gpt-oss-20b", dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  assert cfg.sliding_layers == tuple(range(0, 24, 2)) and cfg.sliding_window == 128
  assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_truncate) == ("yarn", 32.0, False)
  assert cfg.max_seq_len == 131072
  assert round(cfg.num_params() / 1e9, 2) == 20.91  # OpenAI's model card: 20.9B (3.6B active)
  with pytest.raises(CheckpointError, match="attention_bias"):
    config_from_hf(GPT_OSS_20B | {"attention_bias": False})
  with pytest.raises(CheckpointError, match="swiglu_limit"):
    config_from_hf(GPT_OSS_20B | {"swiglu_limit": 0})
