"""save_pretrained's directory: written whole or not at all, a rewrite leaves nothing of the
previous save but what it writes again (and files no save writes), the tokenizer files come from
where the caller says, and token ids reach the generation config without a source."""

import json
import os
import pathlib

import pytest
import transformers
from helpers import hf_checkpoints as hc
from helpers import hf_tokenizers

from jaxrl.config import load_config
from jaxrl.model import hf, load_pretrained, save_pretrained
from jaxrl.rl.policy import export_policy

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A llama checkpoint with the llama3-style tokenizer (which has a chat_template.jinja)."""
  path = hc.write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tokenizer="llama3")
  model, params = load_pretrained(path, dtype="float32")
  return pathlib.Path(path), model, params


def _contents(directory) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(pathlib.Path(directory).iterdir())}


def _siblings(path) -> list[str]:
  return sorted(os.listdir(pathlib.Path(path).parent))


def test_a_save_killed_part_way_leaves_the_previous_one_whole(llama, tmp_path, monkeypatch):
  src, model, params = llama
  out = tmp_path / "out"
  save_pretrained(model, params, out, source=src, max_shard_size=40_000)
  before = _contents(out)
  real = hf.write_file

  def dies_after_the_weights(*args, **kwargs):
    real(*args, **kwargs)
    raise KeyboardInterrupt  # a kill, not an error a caller would handle

  monkeypatch.setattr(hf, "write_file", dies_after_the_weights)
  with pytest.raises(KeyboardInterrupt):
    save_pretrained(model, params, out, source=src)  # one file: it would replace the shards
  assert _contents(out) == before
  assert _siblings(out) == ["out"]  # the part-written copy is gone
  monkeypatch.setattr(hf, "write_file", real)
  again, _ = load_pretrained(out, dtype="float32")
  assert again.config == model.config


def test_a_rewrite_drops_the_previous_saves_files_and_keeps_the_users(llama, tmp_path):
  src, model, params = llama
  out = tmp_path / "out"
  save_pretrained(model, params, out, source=src, max_shard_size=40_000)
  assert (out / "chat_template.jinja").exists()
  (out / "README.md").write_text("my notes")
  (out / "eval").mkdir()
  (out / "eval" / "scores.json").write_text("{}")
  other = pathlib.Path(hf_tokenizers.write_tokenizer(tmp_path / "qwen_tokenizer", "qwen3"))
  save_pretrained(model, params, out, source=src, tokenizer_source=other)
  assert sorted(os.listdir(out)) == [
    "README.md",
    "config.json",
    "eval",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
  ]  # no shards, index or chat_template.jinja of the first save
  assert (out / "README.md").read_text() == "my notes"
  assert (out / "eval" / "scores.json").read_text() == "{}"
  assert (out / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
  # The generation config is still the checkpoint's, not the tokenizer directory's.
  assert (out / "generation_config.json").read_bytes() == (
    src / "generation_config.json"
  ).read_bytes()
  save_pretrained(model, params, out, source=src, tokenizer_source=False)
  assert not (out / "tokenizer.json").exists() and (out / "README.md").exists()
  assert _siblings(out) == ["out", "qwen_tokenizer"]


def test_saving_over_its_own_source_keeps_the_source_files(llama, tmp_path):
  src, model, params = llama
  out = tmp_path / "copy"
  save_pretrained(model, params, out, source=src)
  tokenizer = (out / "tokenizer.json").read_bytes()
  save_pretrained(model, params, out, source=out, dtype="bfloat16")
  assert (out / "tokenizer.json").read_bytes() == tokenizer
  assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_without_a_source_the_token_ids_reach_the_generation_config(llama, tmp_path):
  _, model, params = llama
  out = tmp_path / "out"
  save_pretrained(model, params, out, token_ids={"bos_token_id": 1, "eos_token_id": 2})
  generation = transformers.GenerationConfig.from_pretrained(out)
  assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
  assert transformers.AutoConfig.from_pretrained(out).eos_token_id == 2
  with pytest.raises(ValueError, match="'eos_id' is not one of"):
    save_pretrained(model, params, tmp_path / "bad", token_ids={"eos_id": 2})


def test_a_file_in_the_way_is_a_clear_error(llama, tmp_path):
  _, model, params = llama
  (tmp_path / "out").write_text("not a directory")
  with pytest.raises(NotADirectoryError, match="choose a directory path"):
    save_pretrained(model, params, tmp_path / "out")


def test_the_export_carries_the_runs_tokenizer_not_the_checkpoints(llama, tmp_path):
  src, model, params = llama
  other = pathlib.Path(hf_tokenizers.write_tokenizer(tmp_path / "qwen_tokenizer", "qwen3"))
  config = REPO / "configs" / "grpo_hf.py"
  cfg = load_config(str(config), "test", {"pretrained.path": str(src), "tokenizer": str(other)})
  out = export_policy(cfg, model, params, str(tmp_path / "export"))
  assert (pathlib.Path(out) / "tokenizer.json").read_bytes() == (
    other / "tokenizer.json"
  ).read_bytes()
  assert not (pathlib.Path(out) / "chat_template.jinja").exists()  # the checkpoint's
  cfg = load_config(str(config), "test", {"pretrained.path": str(src), "tokenizer": "byte"})
  out = export_policy(cfg, model, params, str(tmp_path / "byte"))
  assert not (pathlib.Path(out) / "tokenizer.json").exists()
