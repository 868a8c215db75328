"""`load_tokenizer` on files declaring GPT2Tokenizer or GPTNeoXTokenizer: transformers 5 rebuilds
those classes' own pipeline (a byte-level pre-tokenizer with GPT-2's regex, NFC for GPT-NeoX)
in place of the file's, unless the model type registers the plain backend. jaxrl runs the file
(what the model was trained with) and warns where the two give other ids; where they agree, or
transformers runs the file too, it says nothing.

The tokenizer is trained on the spot: a byte-level BPE that learns merges of digits, saved with
a pre-tokenizer that splits digits one by one (as some checkpoints' files do)."""

import json
import logging

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrl.data.hf_tokenizer import load_tokenizer

TEXT = "In 2024, 12345 apples cost $6.78 and Cafe\u0301 is open."
CORPUS = ["the year 2024 and 12345 apples cost 6.78 dollars 1999", "1234567890 12 123"] * 50


def _write(directory, declared, model_type, split_digits=True):
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(
    vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|endoftext|>"]
  )
  tokenizer.train_from_iterator(CORPUS, trainer)
  if split_digits:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
      ]
    )
  tokenizer.save(str(directory / "tokenizer.json"))
  specials = {k: "<|endoftext|>" for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
  config = {"tokenizer_class": declared, **specials}
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
  return tokenizer


def _ids(tokenizer, text=TEXT):
  return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("declared", ["GPT2Tokenizer", "GPT2TokenizerFast", "GPTNeoXTokenizer"])
def test_another_pipeline_under_the_class_runs_as_the_file_and_warns(
  tmp_path, caplog, auto_tokenizer, declared
):
  file = _write(tmp_path, declared, "llama")
  with caplog.at_level(logging.WARNING, logger="jaxrl.data.transformers_pipelines"):
    ours = load_tokenizer(tmp_path)
  assert ours.encode(TEXT) == _ids(file)
  theirs = auto_tokenizer.from_pretrained(tmp_path)(TEXT, add_special_tokens=False)["input_ids"]
  assert theirs != _ids(file)  # what the warning says: transformers 5 gives other ids
  [record] = caplog.records
  assert declared.removesuffix("Fast") in record.getMessage()
  assert "jaxrl runs the file's pipeline" in record.getMessage()


@pytest.mark.parametrize(
  "declared, model_type, split_digits",
  [
    ("GPT2Tokenizer", "llama", False),  # GPT-2's own pipeline: the rebuild is the file
    ("GPT2Tokenizer", "olmo2", True),  # a plain backend: transformers runs the file
    ("GPT2Tokenizer", "phi3", True),
    ("PreTrainedTokenizerFast", "llama", True),
  ],
)
def test_where_transformers_gives_the_files_ids_nothing_is_said(
  tmp_path, caplog, auto_tokenizer, declared, model_type, split_digits
):
  file = _write(tmp_path, declared, model_type, split_digits)
  with caplog.at_level(logging.WARNING, logger="jaxrl.data.transformers_pipelines"):
    ours = load_tokenizer(tmp_path)
  theirs = auto_tokenizer.from_pretrained(tmp_path)(TEXT, add_special_tokens=False)["input_ids"]
  assert ours.encode(TEXT) == theirs == _ids(file)
  assert not caplog.records
