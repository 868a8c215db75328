"""Where transformers 5's AutoTokenizer does not run a checkpoint's tokenizer.json as it is.

AutoTokenizer loads a tokenizer through the class tokenizer_config.json declares, unless the
checkpoint's model type registers the plain backend (`_PLAIN_BACKEND_MODEL_TYPES`), which runs
the file. Several classes build their own pipeline in `__init__`, keeping only the file's
vocabulary, merges and post-processor:

- LlamaTokenizer: no normalizer, a Metaspace pre-tokenizer, its decoder. That is what the
  sentencepiece original does, and older files disagree with it, so jaxrl rebuilds the same
  (`_rebuild_llama_pipeline`; not for a byte-level file, which AutoTokenizer runs as it is).
- GPT2Tokenizer and GPTNeoXTokenizer: a byte-level pre-tokenizer with GPT-2's regex (and NFC for
  GPT-NeoX). For GPT-2's and GPT-NeoX's own files that is the file's pipeline. A file with
  another one under those names (one that splits digits, another regex) is tokenized by
  transformers 5 unlike the file the model was trained with; jaxrl runs the file and warns,
  with a text whose ids differ (`_warn_where_transformers_differs`).
- GemmaTokenizer: a normalizer that turns spaces into "▁", a split on spaces, a byte-fallback
  BPE. That is the pipeline of Gemma's own files (tests/data/hf_gemma_tokenizer_test.py); a file
  with another under that name gets the same warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from jaxrl.data.tokenizer import TokenizerError

log = logging.getLogger(__name__)

# tokenizer_config.json's `tokenizer_class` values whose pipeline transformers 5 rebuilds.
_REBUILT_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")
# Model types transformers 5 registers the plain backend for (`TOKENIZER_MAPPING_NAMES`): their
# AutoTokenizer runs a file declaring another class as it is.
_PLAIN_BACKEND_MODEL_TYPES = ("mistral", "mixtral", "phi3", "olmo2")
# The BPE settings of that rebuild; a file whose BPE has others is refused.
_REBUILT_BPE = {"byte_fallback": True, "fuse_unk": True, "ignore_merges": False, "dropout": None}


def _rebuild_llama_pipeline(
  backend: Any,
  text: str,
  tokenizer_file: str,
  config: Mapping[str, Any],
  model_config: Mapping[str, Any],
) -> None:
  """Where transformers 5's AutoTokenizer would load `_REBUILT_CLASSES` as that class, gives
  `backend` the pipeline that class builds in place of the file's (no normalizer, a Metaspace
  pre-tokenizer whose prepend scheme follows `add_prefix_space` and `legacy`, its decoder),
  keeping the file's vocabulary and merges. AutoTokenizer loads the file as it is instead where
  it names "ByteLevel" anywhere (for model type qwen2, as Qwen2Tokenizer, whose pipeline is a
  Qwen-style file's own: tests/data/hf_tokenizer_test.py), or where config.json's model type
  registers a plain backend (`_PLAIN_BACKEND_MODEL_TYPES`: Mistral, Phi-3, OLMo 2);
  `model_config` is that config.json ({} where none).

  Raises:
    TokenizerError: the file's model is not a BPE with the rebuild's settings, or the model type
      (qwen2) would have it rebuilt as another class.
  """
  declared = config.get("tokenizer_class")
  if declared not in _REBUILT_CLASSES:
    return
  model_type = model_config.get("model_type")
  if '"ByteLevel"' in text or model_type in _PLAIN_BACKEND_MODEL_TYPES:
    return
  from tokenizers import decoders, pre_tokenizers

  model = json.loads(text).get("model") or {}
  found = {key: model.get(key) for key in _REBUILT_BPE}
  # The rebuilt BPE has no unk token; with byte fallback over all 256 bytes none is ever used.
  bytes_known = all(f"<0x{b:02X}>" in (model.get("vocab") or {}) for b in range(256))
  unk_used = model.get("unk_token") and not bytes_known
  if model_type == "qwen2" or model.get("type") != "BPE" or found != _REBUILT_BPE or unk_used:
    raise TokenizerError(
      f"{tokenizer_file}: transformers 5 would not run this file's pipeline but rebuild it "
      f"(tokenizer_class {declared}, model type {model_type}), as a byte-fallback BPE with "
      f"{_REBUILT_BPE} and no unk token, Metaspace pre-tokenizer; this file's model is "
      f"{model.get('type')} with {found}, which jaxrl cannot rebuild the same way."
    )
  prefix_space = config.get("add_prefix_space")
  prefix_space = True if prefix_space is None else bool(prefix_space)
  # transformers' `_get_prepend_scheme`, with LlamaTokenizer's default legacy=False.
  scheme = ("always" if config.get("legacy", False) else "first") if prefix_space else "never"
  backend.normalizer = None
  backend.pre_tokenizer = pre_tokenizers.Metaspace(
    replacement="\u2581", prepend_scheme=scheme, split=False
  )
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  if prefix_space:  # the space the pre-tokenizer put before the text
    steps.append(decoders.Strip(" ", 1, 0))
  backend.decoder = decoders.Sequence(steps)


def _byte_level(nfc: bool):
  def rebuild(config: Mapping[str, Any]) -> tuple[Any, Any, str]:
    from tokenizers import normalizers, pre_tokenizers

    prefix_space = bool(config.get("add_prefix_space", False))
    return (
      normalizers.NFC() if nfc else None,
      pre_tokenizers.ByteLevel(add_prefix_space=prefix_space),
      "a byte-level pre-tokenizer with GPT-2's regex",
    )

  return rebuild


def _gemma(config: Mapping[str, Any]) -> tuple[Any, Any, str]:
  from tokenizers import normalizers, pre_tokenizers

  return (
    normalizers.Replace(" ", "\u2581"),
    pre_tokenizers.Split(" ", "merged_with_previous"),
    "spaces replaced by '\u2581', no prefix",
  )


# tokenizer_config.json's classes whose own pipeline transformers 5 builds over the file's
# vocabulary: config -> (normalizer, pre-tokenizer, what it is, for the warning).
_REBUILDING_CLASSES = {
  "GPT2Tokenizer": _byte_level(nfc=False),
  "GPTNeoXTokenizer": _byte_level(nfc=True),
  "GemmaTokenizer": _gemma,
}
# Texts whose ids show a different pre-tokenizer: digits, contractions, punctuation, spaces,
# accents (NFC), code.
_PROBES = (
  "In 2024, 12345 apples cost $6.78 (about 3.5%).",
  "It's what they'd've done; I'm sure you'll see.",
  "  two  spaces,\ttab\nnew line   ",
  "Cafe\u0301 na\u0131\u0308ve \u00fcber \u65e5\u672c\u8a9e \U0001f600",
  "def f(x):\n    return x**2 + 10_000",
)


def _warn_where_transformers_differs(
  backend: Any, source: str, config: Mapping[str, Any], model_type: str | None
) -> None:
  declared = (config.get("tokenizer_class") or "").removesuffix("Fast")
  if declared not in _REBUILDING_CLASSES or model_type in _PLAIN_BACKEND_MODEL_TYPES:
    return
  if model_type == "qwen2":  # loaded as Qwen2Tokenizer, whatever the file declares
    return
  from tokenizers import Tokenizer

  rebuilt = Tokenizer.from_str(backend.to_str())
  rebuilt.normalizer, rebuilt.pre_tokenizer, what = _REBUILDING_CLASSES[declared](config)
  for probe in _PROBES:
    ours = backend.encode(probe, add_special_tokens=False).ids
    theirs = rebuilt.encode(probe, add_special_tokens=False).ids
    if ours != theirs:
      log.warning(
        "%s: tokenizer_config.json declares %s, and transformers 5's AutoTokenizer rebuilds "
        "that class's own pipeline (%s) in place of this file's: %r is %s there but %s here. "
        "jaxrl runs the file's pipeline, the one the model was trained with.",
        source, declared, what, probe, theirs, ours,
      )  # fmt: skip
      return


def match_transformers(
  backend: Any, text: str, source: str, config: Mapping[str, Any], model_config: Mapping[str, Any]
) -> None:
  """Gives `backend` (the tokenizer.json at `source`, whose text is `text`) the pipeline
  transformers 5's AutoTokenizer runs where jaxrl follows it (LlamaTokenizer), and warns where
  it does not (GPT2Tokenizer, GPTNeoXTokenizer, GemmaTokenizer over another pipeline). `config` is
  tokenizer_config.json, `model_config` the checkpoint's config.json ({} where none).

  Raises:
    TokenizerError: a LlamaTokenizer file whose rebuild jaxrl cannot reproduce.
  """
  _rebuild_llama_pipeline(backend, text, source, config, model_config)
  _warn_where_transformers_differs(backend, source, config, model_config.get("model_type"))
