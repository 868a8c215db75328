"""`load_tokenizer` on Gemma's tokenizers (`tokenizer_class` GemmaTokenizer): transformers 5
rebuilds their pipeline at load (a normalizer that turns spaces into "▁", a split on spaces that
then finds none, a byte-fallback BPE, its decoder). Gemma's own files hold that same pipeline, so
jaxrl runs the file as it is; these tests check that the ids, the text and the BOS are
transformers' for both forms the file's pipeline may take (no pre-tokenizer, or the rebuild's
split).

The tokenizer is trained on the spot in Gemma's layout: specials <pad>, <eos>, <bos>, <unk>,
<mask> first, the 256 byte tokens, the merges, then the chat turn markers.
"""

import functools
import json
import logging

import numpy as np
import pytest

from jaxrl.data.hf_tokenizer import load_tokenizer

CORPUS = (
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
  "How many clips did Natalia sell altogether in April and May?",
  "The answer is 72. Weng earns $12 an hour for babysitting.",
  "  leading spaces and\nnewlines\tand tabs, Ça va? 你好",
)
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
TURNS = ("<start_of_turn>", "<end_of_turn>")
TEXTS = (
  "",
  " ",
  "How many clips?",
  " How many clips?",
  "  two  spaces   here ",
  "Hello\nworld\n\n y",
  "\tTab and Ça va? 你好 🙂 Ж",
  "The answer is 72.<eos>after",
  "<start_of_turn>user\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n5<end_of_turn>",
  "<bos>x <bos> y",
)
FRAGMENTS = list("abcXYZ019 .,!?'\t\n") + ["é", "温", "🙂", "  ", "clips", " the", "▁"]
FRAGMENTS += [*SPECIALS[:3], *TURNS]


@functools.cache
def _tokenizer_json(pre_tokenizer: str) -> str:
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
  from tokenizers import pre_tokenizers as pre
  from tokenizers.trainers import BpeTrainer

  backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  backend.normalizer = normalizers.Replace(" ", "▁")
  if pre_tokenizer == "split":
    backend.pre_tokenizer = pre.Split(" ", "merged_with_previous")
  backend.decoder = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  )
  byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
  trainer = BpeTrainer(vocab_size=560, special_tokens=[*SPECIALS, *byte_tokens])
  backend.train_from_iterator([t.replace(" ", "▁") for t in CORPUS * 10], trainer)
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TURNS])
  backend.post_processor = processors.TemplateProcessing(
    single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
  )
  return backend.to_str()


def _write(directory, pre_tokenizer: str, model_type: str | None):
  (directory / "tokenizer.json").write_text(_tokenizer_json(pre_tokenizer), encoding="utf-8")
  config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False}
  config |= {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  if model_type is not None:  # a checkpoint's directory: AutoTokenizer reads its model type
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
  return directory


def _texts():
  rng = np.random.default_rng(0)
  randoms = ["".join(rng.choice(FRAGMENTS, size=int(rng.integers(1, 20)))) for _ in range(100)]
  return (*TEXTS, *randoms)


@pytest.mark.parametrize(
  "pre_tokenizer, model_type", [("none", "gemma3_text"), ("split", "gemma3_text"), ("none", None)]
)
def test_ids_text_and_bos_are_transformers(tmp_path, auto_tokenizer, pre_tokenizer, model_type):
  directory = _write(tmp_path, pre_tokenizer, model_type)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  assert type(theirs).__name__ == "GemmaTokenizer"  # the class that rebuilds the pipeline
  for text in _texts():
    want = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == want, text
    assert theirs(text)["input_ids"] == [ours.bos_id, *want], text
    until_eos = want[: want.index(ours.eos_id)] if ours.eos_id in want else want
    assert ours.decode(want) == theirs.decode(until_eos, skip_special_tokens=True), text
  assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (2, 1)


def test_another_pipeline_under_the_gemma_class_runs_as_the_file_and_warns(
  tmp_path, caplog, auto_tokenizer
):
  """A file declaring GemmaTokenizer over a Metaspace pre-tokenizer that prepends "▁" (a
  Llama-style file): transformers 5 rebuilds Gemma's pipeline, without the prefix; jaxrl runs
  the file, and says where the ids differ."""
  from tokenizers import Tokenizer, normalizers
  from tokenizers import pre_tokenizers as pre

  file = Tokenizer.from_str(_tokenizer_json("none"))
  file.normalizer = normalizers.Sequence([])
  file.pre_tokenizer = pre.Metaspace(replacement="▁", prepend_scheme="first", split=False)
  _write(tmp_path, "none", "gemma3_text")
  file.save(str(tmp_path / "tokenizer.json"))
  text = "How many clips?"
  with caplog.at_level(logging.WARNING, logger="jaxrl.data.transformers_pipelines"):
    ours = load_tokenizer(tmp_path)
  assert ours.encode(text) == file.encode(text, add_special_tokens=False).ids
  theirs = auto_tokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"]
  assert theirs != ours.encode(text)  # what the warning says
  [record] = caplog.records
  assert "declares GemmaTokenizer" in record.getMessage()


def test_gemma_files_load_without_a_warning(tmp_path, caplog):
  _write(tmp_path, "none", "gemma3_text")
  with caplog.at_level(logging.WARNING, logger="jaxrl.data.transformers_pipelines"):
    load_tokenizer(tmp_path)
  assert not caplog.records
