"""Tests of `load_tokenizer`: the same ids, text and special tokens as transformers.AutoTokenizer
(its chat templates: hf_chat_template_test.py).

The tokenizers are built on the spot by tests/helpers/hf_tokenizers.py (no Hub access; fixtures in
tests/data/conftest.py). Tests that compare with transformers skip when it is not installed (it is
in the dev extra); the error and protocol tests run without it.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import hf_tokenizers
from helpers.hf_tokenizer_cases import CONVERSATIONS, their_ids, variant

from jaxrl.data.hf_tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from jaxrl.data.prompts import encode_prompt
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.hub import PretrainedNotFound

STYLES = hf_tokenizers.STYLES

TEXTS = (
  "",
  " ",
  "Hello world",
  "  leading and trailing  ",
  "tabs\tand\nnewlines\n\n\nthree",
  "\r\n windows\r\n",
  "1234567890 12 345 6789 007",
  "3.14159 + 2,718 = 5.86; x=1e-10",
  "Ünïcödé café naïve 温度是 25 度。 Ответ: 42 🙂👍🏽",
  "e\u0301 is not é until NFC",
  "ﬁ ligature, ＡＢＣ full width, \u200b zero width, \x00 nul \x7f",
  "<|im_end|>",
  "text<|im_start|>user\nhi<|im_end|>\n",
  "<think>\nreason\n</think>\n\nanswer",
  "<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
  "<|begin_of_text|>x<|end_of_text|>",
  "<|endoftext|><|endoftext|>",
  "< |im_end| > <|im_end <im_end|>",
  "The answer is \\boxed{72}.\n#### 72",
  "    def f(x):\n        return x  # comment\n",
  "   \n  \n\t\n",
  "I'd say it's 'quoted' and they're DON'T",
)
# Pieces of random texts: characters of every kind, whitespace runs and special-token text.
FRAGMENTS = (
  list("abcXYZ019 .,!?'\"$#\\{}()+-*/=<>|_\t\n\r")
  + ["é", "e\u0301", "温", "🙂", "Ж", "  ", "\n\n", "   ", "12345", "clips", " the"]
  + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|eot_id|>"]
  + ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]
)


def _random_texts(seed, n=150):
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(FRAGMENTS, size=int(rng.integers(1, 25)))) for _ in range(n)]


def test_satisfies_tokenizer_protocol(ours, style):
  assert isinstance(ours, Tokenizer)
  assert isinstance(ours, HFTokenizer)
  for name in ("vocab_size", "pad_id", "eos_id"):
    assert type(getattr(ours, name)) is int, name
  if style == "qwen3":
    assert ours.bos_id is None
  else:
    assert type(ours.bos_id) is int
  assert all(type(i) is int for i in ours.stop_ids)
  assert all(type(i) is int for i in ours.encode("Hello 123"))


def test_special_ids_match_transformers(ours, theirs, directory):
  from transformers import GenerationConfig

  assert ours.vocab_size == len(theirs) == max(theirs.get_vocab().values()) + 1
  assert ours.bos_id == theirs.bos_token_id
  assert ours.eos_id == theirs.eos_token_id
  expected_pad = theirs.pad_token_id if theirs.pad_token_id is not None else theirs.eos_token_id
  assert ours.pad_id == expected_pad
  config_eos = GenerationConfig.from_pretrained(directory).eos_token_id
  assert set(ours.stop_ids) == {theirs.eos_token_id, *config_eos}
  assert ours.stop_ids[0] == ours.eos_id
  assert len(set(ours.stop_ids)) == len(ours.stop_ids)


def test_stop_ids_cover_the_chat_end_of_turn(ours, style):
  tid = lambda t: hf_tokenizers.token_id(style, t)  # noqa: E731
  if style == "qwen3":
    # The classic bug: the tokenizer's EOS is <|endoftext|>, but chat turns end with <|im_end|>.
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (None, tid("<|endoftext|>"), ours.eos_id)
    assert ours.stop_ids == (tid("<|endoftext|>"), tid("<|im_end|>"))
  else:
    assert (ours.bos_id, ours.eos_id) == (tid("<|begin_of_text|>"), tid("<|eot_id|>"))
    assert ours.pad_id == ours.eos_id  # Llama 3 has no pad token: the documented fallback
    assert ours.stop_ids == (tid("<|eot_id|>"), tid("<|end_of_text|>"), tid("<|eom_id|>"))
  assert ours.vocab_size == hf_tokenizers.BASE_VOCAB_SIZE + len(hf_tokenizers.ADDED_TOKENS[style])


def test_encode_matches_transformers(ours, theirs):
  for text in TEXTS + tuple(_random_texts(0)):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), repr(text)


def test_encode_splits_digits_like_the_original(ours, style):
  # Qwen's pre-tokenizer cuts numbers into digits, Llama 3's into groups of at most three.
  pieces = [ours.decode([i]) for i in ours.encode("1234567")]
  ends = set(np.cumsum([len(p) for p in pieces]).tolist())
  assert "".join(pieces) == "1234567"
  if style == "qwen3":
    assert ends == set(range(1, 8))
  else:
    assert {3, 6, 7} <= ends


def test_decode_matches_transformers(ours, theirs):
  rng = np.random.default_rng(1)
  stops = set(ours.stop_ids)
  for _ in range(300):
    ids = rng.integers(0, ours.vocab_size, size=int(rng.integers(0, 30))).tolist()
    end = next((k for k, i in enumerate(ids) if i in stops), len(ids))
    assert ours.decode(ids) == theirs.decode(ids[:end], skip_special_tokens=True), ids
    assert ours.decode(np.asarray(ids, np.int32)) == ours.decode(ids)
  for text in TEXTS + tuple(_random_texts(2, 50)):
    ids = theirs.encode(text, add_special_tokens=False)
    end = next((k for k, i in enumerate(ids) if i in stops), len(ids))
    assert ours.decode(ids) == theirs.decode(ids[:end], skip_special_tokens=True), repr(text)


def test_decode_skips_specials_stops_and_marks_unknown_ids(ours, theirs):
  head, tail = ours.encode("Natalia sold 48 clips"), ours.encode(" in May")
  for special in theirs.all_special_ids:
    assert ours.decode([special]) == "", special
  for stop in ours.stop_ids:
    assert ours.decode(head + [stop] + tail + [stop]) == "Natalia sold 48 clips"
  rng = np.random.default_rng(3)
  for _ in range(20):
    unknown = [int(rng.integers(ours.vocab_size, 2 * ours.vocab_size)), -int(rng.integers(1, 9))]
    ids = head + [unknown[0]] + tail + [unknown[1]]
    expected = theirs.decode(head) + "\ufffd" + theirs.decode(tail) + "\ufffd"
    assert ours.decode(ids) == expected
    assert ours.decode(np.asarray(ids, np.int64)) == expected


@pytest.mark.parametrize("decoder", ["metaspace", "llama2"])
def test_an_unknown_id_leaves_the_sentencepiece_text_around_it_alone(
  tmp_path, auto_tokenizer, decoder
):
  """A sentencepiece decoder strips the space of the first word it decodes: the text after an
  unknown id must not be decoded as if it began the text."""
  from tokenizers import Tokenizer as Backend
  from tokenizers import decoders, models, pre_tokenizers

  words = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "▁there"]
  backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
  backend.decoder = (
    decoders.Metaspace(prepend_scheme="first", split=True)
    if decoder == "metaspace"
    else decoders.Sequence(
      [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
      ]
    )
  )
  backend.save(str(tmp_path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ours, theirs = load_tokenizer(tmp_path), auto_tokenizer.from_pretrained(tmp_path)
  ids = ours.encode("Hello world there")
  assert ids == theirs.encode("Hello world there", add_special_tokens=False) == [3, 4, 5]
  assert ours.decode(ids) == theirs.decode(ids) == "Hello world there"
  unknown = ours.vocab_size + 3
  assert ours.decode([3, unknown, 4, 1, 5, -1]) == "Hello\ufffd world there\ufffd"
  assert ours.decode([unknown, 3, 4]) == "\ufffd Hello world"


@pytest.mark.parametrize("clean_up", [True, False])
def test_clean_up_spaces_for_wordpiece(tmp_path, auto_tokenizer, clean_up):
  """transformers 5 removes spaces before punctuation for non-BPE models when the config asks."""
  from tokenizers import Tokenizer as Backend
  from tokenizers import decoders, models, pre_tokenizers

  words = ["[PAD]", "[UNK]", "[SEP]", "hello", "world", ".", "?", "!", ",", "'", "don", "t", "s"]
  backend = Backend(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  backend.decoder = decoders.WordPiece(cleanup=False)  # so only the config's clean-up applies
  backend.save(str(tmp_path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "[SEP]"}
  config |= {"pad_token": "[PAD]", "unk_token": "[UNK]", "clean_up_tokenization_spaces": clean_up}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ours, theirs = load_tokenizer(tmp_path), auto_tokenizer.from_pretrained(tmp_path)
  for text in ("hello world. don't, hello's world!", "hello ? [PAD] world , hello"):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
  assert ours.decode(ours.encode("hello world.")) == (
    "hello world." if clean_up else "hello world ."
  )


def test_decode_round_trips_text_without_specials(ours, style):
  for text in ("Hello world", "1234567890 12 345", "温度是 25 度。 🙂", "a\n\n  b\t"):
    assert ours.decode(ours.encode(text)) == text


def test_legacy_special_tokens_map(tmp_path, auto_tokenizer):
  """Without added_tokens_decoder, special_tokens_map.json is read and wins (transformers' rule)."""

  def edit(config):
    del config["added_tokens_decoder"]
    config.update(tokenizer_class="PreTrainedTokenizerFast", eos_token="<|endoftext|>")

  directory = variant(tmp_path, "qwen3", edit)
  special_map = {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_start|>"}
  with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
    json.dump(special_map, f)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  assert ours.eos_id == theirs.eos_token_id == ours.token_to_id("<|im_end|>")
  assert ours.pad_id == theirs.pad_token_id == ours.token_to_id("<|im_start|>")
  messages = CONVERSATIONS["multi_turn"]
  assert ours.apply_chat_template(messages) == their_ids(theirs, messages, True)


def test_named_token_from_the_base_vocabulary_becomes_special(tmp_path, auto_tokenizer):
  base = load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path / "base", "llama3"))
  word = max((base.decode([i]) for i in range(256, hf_tokenizers.BASE_VOCAB_SIZE)), key=len)
  token = base._backend.id_to_token(base.encode(word)[0])  # its byte-level spelling
  directory = variant(tmp_path, "llama3", lambda c: c.update(pad_token=token))
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  assert ours.pad_id == theirs.pad_token_id == base.token_to_id(token)
  assert ours.vocab_size == len(theirs) == base.vocab_size
  for text in (f"say {token} twice{token}", token, f"{word}{token}"):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def _set_post_processor(directory, post_processor):
  path = os.path.join(directory, "tokenizer.json")
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  data["post_processor"] = post_processor
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, ensure_ascii=False)


@pytest.mark.parametrize(
  ("style", "config", "post_processor", "has_bos"),
  [
    ("llama3", {}, "as written", True),
    # GPT-2, Pythia, SmolLM: the config names a bos_token that the post-processor never adds.
    (
      "qwen3",
      {"bos_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"},
      "as written",
      False,
    ),
    ("qwen3", {"bos_token": "<|im_start|>", "add_bos_token": True}, "as written", False),
    ("llama3", {"add_bos_token": True}, None, False),
  ],
)
def test_plain_prompts_start_like_the_original(
  tmp_path, auto_tokenizer, style, config, post_processor, has_bos
):
  """A prompt without a chat template is `tokenizer(text)`: the BOS tokenizer.json's post-processor
  adds (transformers ignores add_bos_token then), not the one the config names."""
  directory = variant(tmp_path, style, lambda c: c.update(config))
  if post_processor != "as written":
    _set_post_processor(directory, post_processor)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  assert (ours.bos_id is not None) == has_bos
  assert ours.special_tokens.get("bos_token") == theirs.bos_token
  for text in ("Hello world", " 12 clips", ""):
    record = {"id": "r", "prompt": text}
    assert encode_prompt(ours, record) == theirs(text)["input_ids"], (text, ours.bos_id)


def test_a_post_processor_that_puts_two_ids_before_a_text_is_refused(tmp_path):
  from tokenizers import Tokenizer as Backend
  from tokenizers import processors

  path = os.path.join(hf_tokenizers.write_tokenizer(tmp_path, "llama3"), "tokenizer.json")
  backend, bos = Backend.from_file(path), "<|begin_of_text|>"
  backend.post_processor = processors.TemplateProcessing(
    single=f"{bos} {bos} $A", special_tokens=[(bos, backend.token_to_id(bos))]
  )
  backend.save(path)
  with pytest.raises(TokenizerError, match="puts 2 ids before a text"):
    load_tokenizer(tmp_path)


def test_split_special_tokens(tmp_path, auto_tokenizer):
  directory = variant(tmp_path, "qwen3", lambda c: c.update(split_special_tokens=True))
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  for text in ("<|im_end|>", "a<|im_start|>user<think>"):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.token_to_id("<|im_end|>") not in ours.encode(text)


def test_directory_without_tokenizer_json(tmp_path):
  with pytest.raises(TokenizerError) as e:
    load_tokenizer(tmp_path)
  assert str(tmp_path) in str(e.value) and "tokenizer.json" in str(e.value)
  assert "tokenizer_config.json" in str(e.value)
  (tmp_path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
  with pytest.raises(TokenizerError, match=r"tokenizer\.model.*save_pretrained"):
    load_tokenizer(tmp_path)
  with pytest.raises(PretrainedNotFound):
    load_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize(
  ("name", "text", "expected"),
  [
    ("tokenizer.json", '{"model": ', "tokenizer.json: not a tokenizers file"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: expected a JSON object"),
    ("generation_config.json", '{"eos_token_id": [', "generation_config.json: not valid JSON"),
    ("generation_config.json", '{"eos_token_id": 100000}', "generation_config.json has eos_"),
    ("generation_config.json", '{"pad_token_id": "x"}', "generation_config.json has pad_"),
    ("chat_template.jinja", "{% for m in messages %}", "chat_template.jinja does not compile"),
    ("chat_template.jinja", "café".encode("latin-1"), "chat_template.jinja: not UTF-8 text"),
    ("additional_chat_templates/tool_use.jinja", b"\xff", "tool_use.jinja: not UTF-8 text"),
  ],
)
def test_malformed_files(tmp_path, name, text, expected):
  directory = hf_tokenizers.write_tokenizer(tmp_path, "qwen3")
  (tmp_path / name).parent.mkdir(exist_ok=True)
  if isinstance(text, bytes):
    (tmp_path / name).write_bytes(text)
  else:
    (tmp_path / name).write_text(text)
  with pytest.raises(TokenizerError) as e:
    load_tokenizer(directory)
  assert expected in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
  ("edit", "expected"),
  [
    ({"chat_template": 3}, "tokenizer_config.json: chat_template must be a string or a list"),
    ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\] must be"),
    ({"eos_token": "<|missing|>"}, "sets eos_token to '<|missing|>', which is not in"),
    ({"pad_token": 5}, "tokenizer_config.json: pad_token: expected a token string"),
    ({"split_special_tokens": "yes"}, "split_special_tokens must be true or false"),
    ({"chat_template": "{{ x | nofilter }}"}, r"key 'chat_template'\) does not compile"),
  ],
)
def test_malformed_config(tmp_path, edit, expected):
  directory = variant(tmp_path, "qwen3", lambda c: c.update(edit))
  with pytest.raises(TokenizerError, match=expected) as e:
    load_tokenizer(directory)
  assert str(tmp_path) in str(e.value)


def test_no_eos_anywhere(tmp_path):
  directory = variant(tmp_path, "qwen3", lambda c: c.update(eos_token=None))
  (tmp_path / "qwen3" / "generation_config.json").unlink()
  with pytest.raises(TokenizerError, match="no EOS token"):
    load_tokenizer(directory)


def test_write_tokenizer_is_stable(tmp_path):
  """Every call, in this process or a fresh one (no cache), writes the same files."""
  tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = "import sys; from helpers import hf_tokenizers as h; h.write_tokenizer(*sys.argv[1:])"
  for style in STYLES:
    a = hf_tokenizers.write_tokenizer(tmp_path / "a" / style, style)
    b = tmp_path / "b" / style
    subprocess.run([sys.executable, "-c", code, b, style], check=True, cwd=tests_dir, timeout=120)
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
      assert (b / name).read_text() == (tmp_path / "a" / style / name).read_text(), name
  assert "chat_template.jinja" in os.listdir(tmp_path / "a" / "llama3")
  assert "chat_template.jinja" not in os.listdir(tmp_path / "a" / "qwen3")
  # Rewriting a directory with another style leaves no file of the first behind.
  rewritten = hf_tokenizers.write_tokenizer(tmp_path / "a" / "llama3", "qwen3")
  assert sorted(os.listdir(rewritten)) == sorted(os.listdir(tmp_path / "a" / "qwen3"))
  with pytest.raises(ValueError, match="unknown tokenizer style"):
    hf_tokenizers.write_tokenizer(tmp_path / "c", "gpt2")


def test_does_not_import_transformers(tmp_path):
  directory = hf_tokenizers.write_tokenizer(tmp_path, "qwen3")
  code = (
    "import sys\n"
    "from jaxrl.data.hf_tokenizer import load_tokenizer\n"
    f"tok = load_tokenizer({directory!r})\n"
    "tok.decode(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]))\n"
    "bad = sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'torch'})\n"
    "assert not bad, bad\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
