"""`load_tokenizer` on tokenizers whose `tokenizer_class` is LlamaTokenizer (Llama 2, Mistral 7B,
DeepSeek's distilled models): transformers 5 rebuilds the pipeline of some of them at load, and
jaxrl must give the same ids and text whichever layout tokenizer.json has and whichever model
type the checkpoint's config.json names.

The tokenizer is trained on the spot (a byte-fallback BPE over "▁"-joined words, as sentencepiece
models are converted), in the two layouts the Hub holds: the older one (a Prepend + Replace
normalizer, no pre-tokenizer) and the newer one (a Metaspace pre-tokenizer).
"""

import functools
import json
import os

import numpy as np
import pytest

from jaxrl.data.hf_tokenizer import TokenizerError, load_tokenizer

CORPUS = (
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
  "How many clips did Natalia sell altogether in April and May?",
  "The answer is 72. Weng earns $12 an hour for babysitting.",
  "  leading spaces and\nnewlines\tand tabs, Ça va? 你好",
)
SPECIALS = ("<unk>", "<s>", "</s>")
TEXTS = (
  "",
  " ",
  "How many clips?",
  " How many clips?",
  "  two  spaces   here ",
  "Hello\nworld\n\n y",
  "\tTab and Ça va? 你好 🙂 Ж",
  "The answer is 72.</s>after",
  "The answer is 72.</s> after",
  "[INST]hi[/INST]",
  "[INST] What is 2+3? [/INST] 5</s>",
  "<s>x <s> y",
)
FRAGMENTS = list("abcXYZ019 .,!?'\t\n") + ["é", "温", "🙂", "  ", "clips", " the", "▁"]
FRAGMENTS += ["<s>", "</s>", "[INST]", "[/INST]"]


@functools.cache
def _tokenizer_json(layout: str) -> str:
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
  from tokenizers import pre_tokenizers as pre
  from tokenizers.trainers import BpeTrainer

  backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  if layout == "normalizer":
    backend.normalizer = normalizers.Sequence(
      [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
  else:
    backend.pre_tokenizer = pre.Metaspace(replacement="▁", prepend_scheme="first", split=False)
  backend.decoder = decoders.Sequence(
    [
      decoders.Replace("▁", " "),
      decoders.ByteFallback(),
      decoders.Fuse(),
      decoders.Strip(" ", 1, 0),
    ]
  )
  byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
  trainer = BpeTrainer(vocab_size=560, special_tokens=[*SPECIALS, *byte_tokens])
  texts = [f"▁{t.replace(' ', '▁')}" if layout == "normalizer" else t for t in CORPUS * 10]
  backend.train_from_iterator(texts, trainer)
  added = [*SPECIALS, "[INST]", "[/INST]"]
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
  backend.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
  )
  return backend.to_str()


def _write(directory, layout, model_type=None, **config):
  (directory / "tokenizer.json").write_text(_tokenizer_json(layout), encoding="utf-8")
  base = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
  base |= {"unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
  (directory / "tokenizer_config.json").write_text(json.dumps(base | config))
  if model_type is not None:  # a checkpoint's directory: AutoTokenizer reads its model type
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
  return directory


def _assert_same(ours, theirs, texts):
  for text in texts:
    want = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == want, text
    bos = [] if ours.bos_id is None else [ours.bos_id]
    assert theirs(text)["input_ids"] == [*bos, *want], text
    until_eos = want[: want.index(ours.eos_id)] if ours.eos_id in want else want
    assert ours.decode(want) == theirs.decode(until_eos, skip_special_tokens=True), text
  assert ours.bos_id == theirs.bos_token_id


def _texts():
  rng = np.random.default_rng(0)
  randoms = ["".join(rng.choice(FRAGMENTS, size=int(rng.integers(1, 20)))) for _ in range(100)]
  return (*TEXTS, *randoms)


@pytest.mark.parametrize(
  "layout, config, model_type",
  [
    ("normalizer", {"legacy": True}, None),
    ("normalizer", {"legacy": False}, None),
    ("normalizer", {"add_prefix_space": False}, None),
    ("normalizer", {"legacy": False}, "llama"),  # rebuilt
    ("normalizer", {"legacy": False}, "mistral"),  # run as it is
    ("metaspace", {"legacy": False}, None),
    ("metaspace", {"legacy": True}, None),
    ("metaspace", {}, "mistral"),
    # transformers 5 registers a plain backend for these model types too: run as it is.
    ("normalizer", {"legacy": False}, "phi3"),
    ("normalizer", {"legacy": False}, "mixtral"),
    ("normalizer", {"legacy": False}, "olmo2"),
    # and its own class for none of these: rebuilt as the declared LlamaTokenizer.
    ("normalizer", {"legacy": False}, "smollm3"),
    ("normalizer", {"legacy": False}, "qwen3"),
    ("normalizer", {"legacy": False}, "olmoe"),
  ],
)
def test_ids_text_and_bos_are_transformers_whatever_the_layout(
  tmp_path, auto_tokenizer, layout, config, model_type
):
  directory = _write(tmp_path, layout, model_type, **config)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  _assert_same(ours, theirs, _texts())
  assert ours.bos_id == 1


def test_a_byte_level_file_under_the_llama_class_is_run_as_it_is(tmp_path, auto_tokenizer):
  """DeepSeek's distilled models declare LlamaTokenizerFast over a byte-level tokenizer.json,
  which AutoTokenizer then runs as it is."""
  from helpers import hf_tokenizers

  directory = hf_tokenizers.write_tokenizer(tmp_path, "qwen3")
  path = os.path.join(directory, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f) | {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}
  with open(path, "w") as f:
    json.dump(config, f)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  texts = ("Hello world", " 12 clips?", "a\nb  c", "<|im_start|>user\nhi<|im_end|>")
  _assert_same(ours, theirs, texts)


def test_the_older_layout_is_not_read_as_it_is(tmp_path, auto_tokenizer):
  """The case the rebuild is for: its normalizer puts a second "▁" before a leading space,
  which transformers 5 does not."""
  from tokenizers import Tokenizer as Backend

  directory = _write(tmp_path, "normalizer", legacy=False)
  as_written = Backend.from_file(str(directory / "tokenizer.json"))
  text = " How many clips?"
  want = auto_tokenizer.from_pretrained(directory)(text, add_special_tokens=False)["input_ids"]
  assert as_written.encode(text, add_special_tokens=False).ids != want
  assert load_tokenizer(directory).encode(text) == want


def test_a_model_the_rebuild_would_replace_is_refused(tmp_path):
  from tokenizers import Tokenizer as Backend
  from tokenizers import models

  words = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3}
  Backend(models.WordLevel(words, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
  config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(TokenizerError, match=r"tokenizer\.json: transformers 5 would not run"):
    load_tokenizer(tmp_path)
