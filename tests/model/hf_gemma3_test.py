"""Gemma 3's multimodal checkpoints (4B and up, Gemma3ForConditionalGeneration): jaxrl reads the
language model and leaves the vision tower on disk; its logits on text are those of
transformers' multimodal model; saved, it is a Gemma3ForCausalLM that transformers loads with the
same logits. (The text-only Gemma 3, `gemma3_text`, is tested with the other architectures in
`hf_test.py`.)"""

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from helpers import hf_checkpoints as hc
from safetensors.numpy import load_file, save_file

from jaxrl.model import CheckpointError, load_pretrained, save_pretrained


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
  """(checkpoint directory, transformers' logits of a text batch, the batch)."""
  path = hc.write_gemma3_multimodal(tmp_path_factory.mktemp("gemma3"))
  reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(
    path, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  tokens = np.random.default_rng(0).integers(3, hc.VOCAB_SIZE - 3, (2, 100))
  with torch.no_grad():
    want = reference(torch.as_tensor(tokens)).logits.float().numpy()
  return path, want, tokens


def _logits(path, tokens):
  model, params = load_pretrained(path, dtype="float32")
  return model, params, np.asarray(model.apply(params, tokens)[0])


def test_reads_the_language_model(multimodal, caplog):
  path, want, tokens = multimodal
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
  with caplog.at_level(logging.INFO, logger="jaxrl.model.hf"):
    model, _, got = _logits(path, tokens)
  assert hc.rel_err(got, want) < 1e-4
  assert model.config.sliding_layers == (0, 1, 3, 4) and model.config.tie_embeddings
  [line] = [
    r.getMessage() for r in caplog.records if "reading the language model" in r.getMessage()
  ]
  assert "vision_tower" in line or "multi_modal_projector" in line


def test_reads_transformers_5_names(multimodal, tmp_path):
  """transformers 5 holds the language model as `model.language_model.*` in memory; a file
  written with those names reads the same."""
  path, want, tokens = multimodal
  tensors = load_file(os.path.join(path, "model.safetensors"))
  renamed = {
    name.replace("language_model.model.", "model.language_model.", 1): value
    for name, value in tensors.items()
  }
  assert "model.language_model.embed_tokens.weight" in renamed
  save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  assert hc.rel_err(_logits(tmp_path, tokens)[2], want) < 1e-4


@pytest.mark.parametrize("with_source", [True, False])
def test_saves_the_language_model(multimodal, tmp_path, with_source):
  path, want, tokens = multimodal
  model, params = load_pretrained(path, dtype="float32")
  save_pretrained(model, params, tmp_path / "out", source=path if with_source else None)
  with open(tmp_path / "out" / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["Gemma3ForCausalLM"]
  # The source's stop ids come along (its generation_config.json is copied too).
  assert config["eos_token_id"] == ([2, 5] if with_source else None)
  reloaded = hc.load_model(tmp_path / "out")
  assert hc.rel_err(hc.logits(reloaded, tokens), want) < 1e-4


def test_a_checkpoint_without_its_language_model(multimodal, tmp_path):
  path, _, _ = multimodal
  tensors = load_file(os.path.join(path, "model.safetensors"))
  vision = {k: v for k, v in tensors.items() if not k.startswith("language_model.")}
  save_file(vision, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  with pytest.raises(CheckpointError, match="no language-model tensor"):
    load_pretrained(tmp_path, dtype="float32")


def test_config_errors(multimodal, tmp_path):
  path, _, _ = multimodal
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  for change, match in [
    ({"text_config": None}, "needs a text_config"),
    ({"architectures": ["Gemma3ForCausalLM"]}, "language model of Gemma3ForConditionalGeneration"),
  ]:
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    shutil.copyfile(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
      load_pretrained(tmp_path, dtype="float32")
