"""Tests of `load_tokenizer`: the same ids, text and chat templates as transformers.AutoTokenizer.

The tokenizers are built on the spot by tests/helpers/hf_tokenizers.py (no Hub access). Tests that
compare with transformers skip when it is not installed (it is in the dev extra); the error and
protocol tests run without it.
"""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import hf_tokenizers

from jaxrl.data.hf_tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from jaxrl.data.prompts import encode_prompt
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.hub import PretrainedNotFound

STYLES = hf_tokenizers.STYLES
DATE = {"date_string": "26 Jul 2024"}  # the llama3 template reads today's date without it

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

CONVERSATIONS = {
  "one_user": [{"role": "user", "content": "What is 17 * 23?"}],
  "system": [
    {"role": "system", "content": "Reason step by step; put the answer in \\boxed{}."},
    {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May."},
  ],
  "multi_turn": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "  Ünïcödé 🙂 <b>&amp;</b>\n\nsum 1..100?  "},
  ],
  "reasoning_in_content": [
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "<think>\nearly thought\n</think>\n\n4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nlate thought\n</think>\n\n6"},
  ],
  "reasoning_fields": [
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    {"role": "user", "content": "3 + 3?"},
    {"role": "assistant", "content": "6", "thinking": "an alias", "name": None},
  ],
}
GENERATION_KWARGS = ({}, {"enable_thinking": False}, {"enable_thinking": True})
TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "calculator",
      "description": "Evaluates <expr> & returns a number, e.g. «2+2».",
      "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
  }
]
TOOL_CONVERSATION = [
  {"role": "user", "content": "Use the tool: 2 + 2"},
  {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "calculator", "arguments": {"expr": "2 + 2 ≠ <5>"}}}],
  },
  {"role": "tool", "content": "4"},
]


@pytest.fixture(scope="module")
def auto_tokenizer():
  return pytest.importorskip("transformers").AutoTokenizer


@pytest.fixture(scope="module", params=STYLES)
def style(request):
  return request.param


@pytest.fixture(scope="module")
def directory(style, tmp_path_factory):
  return hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp(style), style)


@pytest.fixture(scope="module")
def ours(directory):
  return load_tokenizer(directory)


@pytest.fixture(scope="module")
def theirs(directory, auto_tokenizer):
  return auto_tokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  return load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("q"), "qwen3"))


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  return hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("l"), "llama3")


def _variant(tmp_path, style, edit_config=None, files=None):
  """A tokenizer directory of `style` with its tokenizer_config.json edited and files added."""
  directory = hf_tokenizers.write_tokenizer(tmp_path / style, style)
  path = os.path.join(directory, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  if edit_config is not None:
    edit_config(config)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(config, f)
  for name, text in (files or {}).items():
    os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
      f.write(text)
  return directory


def _random_texts(seed, n=150):
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(FRAGMENTS, size=int(rng.integers(1, 25)))) for _ in range(n)]


def _their_ids(theirs, messages, add_generation_prompt, **kwargs):
  kwargs |= {"add_generation_prompt": add_generation_prompt, "tokenize": True, "return_dict": False}
  return theirs.apply_chat_template(copy.deepcopy(messages), **kwargs)


def _their_text(theirs, messages, add_generation_prompt, **kwargs):
  kwargs |= {"add_generation_prompt": add_generation_prompt, "tokenize": False}
  return theirs.apply_chat_template(copy.deepcopy(messages), **kwargs)


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


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, style, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  for kwargs in GENERATION_KWARGS:
    kwargs = {**kwargs, **(DATE if style == "llama3" else {})}
    text = ours.render_chat_template(copy.deepcopy(messages), add_generation_prompt, **kwargs)
    assert text == _their_text(theirs, messages, add_generation_prompt, **kwargs)
    ids = ours.apply_chat_template(copy.deepcopy(messages), add_generation_prompt, **kwargs)
    assert ids == _their_ids(theirs, messages, add_generation_prompt, **kwargs)
    assert ours.encode(text) == ids


def test_chat_template_with_tools_matches_transformers(ours, theirs, style):
  kwargs = DATE if style == "llama3" else {}
  conversations = [CONVERSATIONS["system"], CONVERSATIONS["one_user"]]
  if style == "qwen3":
    conversations.append(TOOL_CONVERSATION)
  for messages in conversations:
    text = ours.render_chat_template(messages, tools=TOOLS, **kwargs)
    assert text == _their_text(theirs, messages, True, tools=TOOLS, **kwargs)
    assert "«2+2»" in text and "<expr> & returns" in text  # tojson keeps unicode, no HTML escapes
    assert ours.apply_chat_template(messages, tools=TOOLS, **kwargs) == _their_ids(
      theirs, messages, True, tools=TOOLS, **kwargs
    )


def test_chat_template_reads_today_like_transformers(llama3_dir, auto_tokenizer):
  messages = CONVERSATIONS["one_user"]
  text = load_tokenizer(llama3_dir).render_chat_template(messages)
  assert text == _their_text(auto_tokenizer.from_pretrained(llama3_dir), messages, True)
  assert "Today Date: " in text and "date_string" not in text


def test_qwen3_template_thinking(qwen3):
  ours = qwen3
  text = ours.render_chat_template(CONVERSATIONS["reasoning_in_content"], False)
  assert "early thought" not in text  # reasoning before the last user message is dropped
  assert "<|im_start|>assistant\n4<|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n<think>\nlate thought\n</think>\n\n6<|im_end|>\n")
  prompt = CONVERSATIONS["one_user"]
  assert ours.render_chat_template(prompt).endswith(
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"
  )
  no_thinking = ours.render_chat_template(prompt, enable_thinking=False)
  assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert not ours.render_chat_template(prompt).startswith("<|im_start|>system")
  ids = ours.apply_chat_template(prompt)
  assert ids[0] == ours.token_to_id("<|im_start|>") and ours.bos_id is None


def test_llama3_template_writes_one_bos(llama3_dir):
  ours = load_tokenizer(llama3_dir)
  ids = ours.apply_chat_template(CONVERSATIONS["multi_turn"], **DATE)
  assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1
  header = ours.encode("<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert ids[-len(header) :] == header
  assert ours.decode(ids).startswith("system\n\nCutting Knowledge Date")


ENV_TEMPLATE = """\
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {%- if ns.n > 3 %}{% break %}{% endif %}
[{{ m.role }}|{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}]
  {{ m | tojson(ensure_ascii=true) }} {{ m | tojson(separators=(',', ':')) }}
  {{ dict(a=1, b=m.role) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}
    {% generation %}{{ m.content | upper }}{% endgeneration %}

{% endfor %}
{{- bos_token }}|{{ eos_token }}|{{ pad_token | default('no pad') }}|{{ unk_token is defined }}
{{- '|' ~ custom | default('none') ~ '|' ~ (tools | length if tools else 'no tools') }}
{{- '|' ~ strftime_now('%Y') ~ '|' ~ add_generation_prompt }}
"""


def test_template_environment_matches_transformers(tmp_path, auto_tokenizer):
  """Loop controls, namespace, dict, tojson's options, the generation tag, special-token
  variables, None keys dropped, reasoning aliases and numpy values: as transformers renders."""
  directory = _variant(tmp_path, "llama3", files={"chat_template.jinja": ENV_TEMPLATE})
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = [
    {"role": "system", "content": "Be «brief» & <exact>", "name": None},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "Ünï\n", "score": np.float32(0.5), "n": np.int64(3)},
    {"role": "assistant", "content": "4", "reasoning": "two and two", "tags": ("a", "b")},
    {"role": "user", "content": "after the break"},
  ]
  for kwargs in ({}, {"custom": "set", "tools": TOOLS}, {"add_generation_prompt": False}):
    kwargs = {"add_generation_prompt": True, **kwargs}
    agp = kwargs.pop("add_generation_prompt")
    text = ours.render_chat_template(copy.deepcopy(messages), agp, **kwargs)
    assert text == _their_text(theirs, messages, agp, **kwargs)
    assert "after the break" not in text and "never shown" not in text
    assert '"reasoning_content": "two and two"' in text and '"name"' not in text
  assert "<|begin_of_text|>|<|eot_id|>|no pad|False|" in text


def _marked(template, marker):
  return template.replace("<|im_start|>assistant\n{% if", f"{marker}<|im_start|>assistant\n{{% if")


def test_named_templates_in_config(tmp_path, auto_tokenizer):
  template = hf_tokenizers.QWEN3_TEMPLATE
  named = [
    {"name": "default", "template": _marked(template, "[default]")},
    {"name": "tool_use", "template": _marked(template, "[tool_use]")},
  ]
  directory = _variant(tmp_path, "qwen3", lambda c: c.update(chat_template=named))
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = CONVERSATIONS["system"]
  for tools in (None, TOOLS, []):
    text = ours.render_chat_template(messages, tools=tools)
    assert text == _their_text(theirs, messages, True, tools=tools)
    assert ("[tool_use]" if tools is not None else "[default]") in text
  assert set(ours.chat_templates) == {"default", "tool_use"}


def test_template_files_replace_the_config_template(tmp_path, auto_tokenizer):
  template = hf_tokenizers.QWEN3_TEMPLATE
  files = {
    "chat_template.jinja": _marked(template, "[file]"),
    "additional_chat_templates/tool_use.jinja": _marked(template, "[extra file]"),
  }
  directory = _variant(tmp_path, "qwen3", files=files)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = CONVERSATIONS["one_user"]
  for tools in (None, TOOLS):
    text = ours.render_chat_template(messages, tools=tools)
    assert text == _their_text(theirs, messages, True, tools=tools)
    assert ("[extra file]" if tools else "[file]") in text


def test_legacy_special_tokens_map(tmp_path, auto_tokenizer):
  """Without added_tokens_decoder, special_tokens_map.json is read and wins (transformers' rule)."""

  def edit(config):
    del config["added_tokens_decoder"]
    config.update(tokenizer_class="PreTrainedTokenizerFast", eos_token="<|endoftext|>")

  directory = _variant(tmp_path, "qwen3", edit)
  special_map = {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_start|>"}
  with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
    json.dump(special_map, f)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  assert ours.eos_id == theirs.eos_token_id == ours.token_to_id("<|im_end|>")
  assert ours.pad_id == theirs.pad_token_id == ours.token_to_id("<|im_start|>")
  messages = CONVERSATIONS["multi_turn"]
  assert ours.apply_chat_template(messages) == _their_ids(theirs, messages, True)


def test_named_token_from_the_base_vocabulary_becomes_special(tmp_path, auto_tokenizer):
  base = load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path / "base", "llama3"))
  word = max((base.decode([i]) for i in range(256, hf_tokenizers.BASE_VOCAB_SIZE)), key=len)
  token = base._backend.id_to_token(base.encode(word)[0])  # its byte-level spelling
  directory = _variant(tmp_path, "llama3", lambda c: c.update(pad_token=token))
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
  directory = _variant(tmp_path, style, lambda c: c.update(config))
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
  directory = _variant(tmp_path, "qwen3", lambda c: c.update(split_special_tokens=True))
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
  directory = _variant(tmp_path, "qwen3", lambda c: c.update(edit))
  with pytest.raises(TokenizerError, match=expected) as e:
    load_tokenizer(directory)
  assert str(tmp_path) in str(e.value)


def test_no_eos_anywhere(tmp_path):
  directory = _variant(tmp_path, "qwen3", lambda c: c.update(eos_token=None))
  (tmp_path / "qwen3" / "generation_config.json").unlink()
  with pytest.raises(TokenizerError, match="no EOS token"):
    load_tokenizer(directory)


def test_template_errors_name_their_source(tmp_path, auto_tokenizer):
  """A template that raises fails here as in transformers, and says which file it came from."""
  import jinja2

  qwen = hf_tokenizers.write_tokenizer(tmp_path / "qwen3", "qwen3")
  llama = hf_tokenizers.write_tokenizer(tmp_path / "llama3", "llama3")
  late_system = CONVERSATIONS["one_user"] + [{"role": "system", "content": "late"}]
  cases = [
    (qwen, late_system, "A system message may only come first", "key 'chat_template'"),
    (qwen, [{"role": "robot", "content": "beep"}], "Unknown role: robot", "key 'chat_template'"),
    (llama, TOOL_CONVERSATION, "Unknown role: tool", "chat_template.jinja"),
  ]
  for directory, messages, message, where in cases:
    with pytest.raises(TokenizerError, match=message) as e:
      load_tokenizer(directory).apply_chat_template(messages)
    assert os.path.join(directory, "") in str(e.value) and where in str(e.value)
    with pytest.raises(jinja2.TemplateError, match=message):
      auto_tokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False)

  sandbox = "{% set ns = namespace(n=0) %}{% set ns._secret = 1 %}{{ ns.n }}"
  directory = _variant(tmp_path, "qwen3", lambda c: c.update(chat_template=sandbox))
  with pytest.raises(TokenizerError, match="SecurityError"):
    load_tokenizer(directory).render_chat_template(CONVERSATIONS["one_user"])


def test_chat_inputs_errors(tmp_path, qwen3):
  tok = qwen3
  with pytest.raises(TokenizerError, match="empty list of messages"):
    tok.apply_chat_template([])
  with pytest.raises(TypeError, match="chat messages and tools must be dicts, got .hello."):
    tok.apply_chat_template(["hello"])
  with pytest.raises(TypeError, match="get_json_schema"):
    tok.apply_chat_template(CONVERSATIONS["one_user"], tools=[len])

  directory = _variant(tmp_path, "qwen3", lambda c: c.pop("chat_template"))
  base = load_tokenizer(directory)
  assert base.chat_templates == {}
  with pytest.raises(TokenizerError, match="no chat template") as e:
    base.apply_chat_template(CONVERSATIONS["one_user"])
  assert directory in str(e.value)
  named = [{"name": "tool_use", "template": "{{ messages }}"}]
  directory = _variant(tmp_path / "n", "qwen3", lambda c: c.update(chat_template=named))
  with pytest.raises(TokenizerError, match=r"none of \['tool_use'\] is 'default'"):
    load_tokenizer(directory).apply_chat_template(CONVERSATIONS["one_user"])


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
