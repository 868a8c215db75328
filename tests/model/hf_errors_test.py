"""Hugging Face checkpoints that jaxrl refuses: each error names its file and the tensor or
config.json key (a model option it does not implement, a missing or unexpected tensor, a
shape against config.json, a missing shard, PyTorch pickles, a tied head that differs), and
the shard layouts transformers leaves behind that still load. The `checkpoints` fixture:
`conftest.py`."""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import hf_checkpoints as hc
from safetensors.numpy import load_file, save_file

from jaxrl.model import CheckpointError, load_pretrained

from .hf_test import _copy, _load_json, _tokens, _write  # noqa: TID252


@pytest.mark.parametrize(
  "arch,change,key",
  [
    ("qwen3", {"model_type": "gemma2"}, "model_type"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("llama", {"architectures": ["Qwen2ForCausalLM"]}, "architectures"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type"),
    ("qwen3", {"hidden_size": None}, "hidden_size"),
    ("qwen3", {"hidden_size": "64"}, "hidden_size"),
  ],
)
def test_config_errors_name_the_key(checkpoints, tmp_path, arch, change, key):
  path = _copy(checkpoints(arch), tmp_path)
  config = _load_json(path / "config.json") | change
  config = {k: v for k, v in config.items() if v is not None}
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=rf"config\.json.*{key}"):
    load_pretrained(path)


def _rewrite(path, edit):
  tensors = load_file(path / "model.safetensors")
  edit(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(checkpoints, tmp_path):
  path = _copy(checkpoints("qwen3"), tmp_path)
  _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
  with pytest.raises(
    CheckpointError,
    match=r"model\.safetensors: tensor model\.layers\.1\.self_attn\.k_norm\.weight is missing",
  ):
    load_pretrained(path)


def test_unexpected_tensor(checkpoints, tmp_path):
  path = _copy(checkpoints("llama"), tmp_path)
  bias = np.random.default_rng().normal(size=64).astype(np.float32)
  _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": bias}))
  with pytest.raises(
    CheckpointError,
    match=r"model\.safetensors: unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias.*bias",
  ):
    load_pretrained(path)


def test_shape_disagrees_with_config(checkpoints, tmp_path):
  path = _copy(checkpoints("qwen2"), tmp_path)
  wrong = np.random.default_rng().normal(size=(127, 64)).astype(np.float32)
  _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": wrong}))
  with pytest.raises(
    CheckpointError,
    match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight has shape "
    r"\[127, 64\], but config\.json gives \[128, 64\]",
  ):
    load_pretrained(path)


def test_missing_shard(tmp_path):
  path = _write(tmp_path / "sharded", "qwen3", max_shard_size="40KB")
  index = _load_json(path / "model.safetensors.index.json")
  shard = sorted(set(index["weight_map"].values()))[1]
  os.remove(path / shard)
  with pytest.raises(
    CheckpointError, match=rf"model\.safetensors\.index\.json: shard {shard} .* is missing"
  ):
    load_pretrained(path)


def test_stale_index_beside_one_file(tmp_path):
  # transformers saving a sharded checkpoint again as one file removes the shards but keeps
  # the index; it loads the one file, and so must jaxrl.
  path = tmp_path / "resaved"
  hf_model = hc.make_model("qwen3")
  hf_model.save_pretrained(path, max_shard_size="40KB")
  hf_model.save_pretrained(path)
  files = os.listdir(path)
  assert "model.safetensors.index.json" in files and "model.safetensors" in files
  tokens = _tokens(np.random.default_rng())
  want = hc.logits(hc.load_model(path), tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4


def test_complete_shards_win_over_an_old_single_file(tmp_path):
  # The other way round: one file, then shards of other weights. Every shard is there, so the
  # index (the newer save) is read.
  path = tmp_path / "resaved"
  hc.make_model("qwen3").save_pretrained(path)
  newer = hc.make_model("qwen3", seed=1)
  newer.save_pretrained(path, max_shard_size="40KB")
  tokens = _tokens(np.random.default_rng())
  want = hc.logits(newer, tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4


def test_pytorch_pickles_are_refused_unread(checkpoints, tmp_path):
  path = tmp_path / "pickles"
  path.mkdir()
  shutil.copy(checkpoints("qwen3") / "config.json", path)
  (path / "pytorch_model.bin").write_bytes(b"not even a pickle")
  with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors only"):
    load_pretrained(path)


def test_missing_config(tmp_path):
  with pytest.raises(CheckpointError, match=r"config\.json: not found"):
    load_pretrained(tmp_path)


def test_tied_heads(checkpoints, tmp_path):
  tied = checkpoints("qwen3", tied=True)
  # A tied checkpoint that also stores the head (as some exports do) loads when they agree.
  equal = _copy(tied, tmp_path, "equal")
  _rewrite(equal, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  model, params = load_pretrained(equal, dtype="float32")
  assert model.config.tie_embeddings and "lm_head_dv" not in params
  differs = _copy(tied, tmp_path, "differs")
  _rewrite(differs, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
  with pytest.raises(CheckpointError, match=r"lm_head\.weight differs .*tie_word_embeddings"):
    load_pretrained(differs)
  # An untied config needs the head.
  untied = _copy(tied, tmp_path, "untied")
  config = _load_json(untied / "config.json") | {"tie_word_embeddings": False}
  (untied / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"tensor lm_head\.weight is missing"):
    load_pretrained(untied)
