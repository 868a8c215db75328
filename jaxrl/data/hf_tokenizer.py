"""Hugging Face tokenizers and chat templates, read with `tokenizers` and `jinja2` alone.

`load_tokenizer(path)` reads a pretrained model's tokenizer files (a local directory or a Hub id,
through `jaxrl.hub.resolve_pretrained`) into an `HFTokenizer`: the `Tokenizer` protocol of
`jaxrl.data.tokenizer` (with `bos_id` possibly None), the stop ids and the chat template.

Why not `transformers`: it is a large dependency (torch with it) that a JAX trainer would import
for one class, and its tokenizer classes rebuild and patch the tokenizer at load time in ways that
change between releases. What a model was trained with is tokenizer.json (the `tokenizers`
pipeline) and a Jinja chat template; both run here through the libraries transformers itself
calls, so fidelity rests on the rules around them, restated below from transformers 5 and checked
against `transformers.AutoTokenizer` by tests/data/hf_tokenizer_test.py (ids, text, templates,
special ids), so a drift in either library fails a test.

The rules. tokenizer.json is required. tokenizer_config.json names the special tokens (bos_token,
eos_token, ... and any other `*_token` key whose value is a token), the extra special tokens,
`split_special_tokens`, `clean_up_tokenization_spaces` (non-BPE models only) and the chat
template; special_tokens_map.json is read only when it has no `added_tokens_decoder`, and then
wins. chat_template.jinja (with additional_chat_templates/*.jinja) replaces the config's
templates. Named special tokens are special in the backend, so decode skips them. Templates render
in an immutable sandbox with trim_blocks, lstrip_blocks and loop controls; a `tojson` that keeps
non-ASCII and escapes no HTML; `raise_exception`, `strftime_now`, a restricted `dict` and
`namespace`; the special tokens as variables; `{% generation %}` rendered as its body. Messages
become plain data without None values, `reasoning_content`/`thinking` filled from each other (or
`reasoning`). With `tools`, a template named "tool_use" wins over "default". `bos_id`, what a
plain-text prompt starts with, is the id tokenizer.json's post-processor puts before a text, as
in `tokenizer(text)` (add_bos_token is ignored there too), not the config's bos_token.

Differences on purpose: tokenizer.json's padding and truncation are off; a BOS, EOS or PAD missing
from the vocabulary raises (transformers would append an id the model lacks), other missing named
tokens are ignored; the special-token defaults of transformers' model-specific classes (used when
tokenizer_config.json omits a key) are not applied; no `continue_final_message` or
`sanitize_control_tokens`; an EOS the post-processor appends is not put after prompts. A
directory with only a sentencepiece tokenizer.model (or vocab.json + merges.txt) needs
converting: `AutoTokenizer.from_pretrained(d).save_pretrained(d)`.

Rebuilt pipelines. transformers 5's `LlamaTokenizer` (the `tokenizer_class` of Llama 2 and
its fine-tunes) does not run tokenizer.json's pipeline: it takes the vocabulary and merges and
builds its own (no normalizer, a Metaspace pre-tokenizer, byte fallback). Older files (a
Prepend + Replace normalizer) would tokenize differently: a leading space, for one. Its
AutoTokenizer rebuilds only where the file is not byte-level (DeepSeek's distilled models
declare the class over a byte-level file) and the checkpoint's model type registers no other
tokenizer (Mistral's, Mixtral's, Phi-3's and OLMo 2's run the file as they are); the loader
does the same. Files declaring GPT2Tokenizer or GPTNeoXTokenizer run as they are, with a
warning where transformers 5's rebuild of those classes gives other ids
(`transformers_pipelines`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jaxrl.data.chat_template import alias_reasoning, environment, plain
from jaxrl.data.tokenizer import TokenizerError
from jaxrl.data.transformers_pipelines import match_transformers
from jaxrl.hub import resolve_pretrained

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Files that hold a tokenizer this module cannot read, named in the error for a directory.
_UNSUPPORTED_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tekken.json")
_EXTRA_LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")
# transformers' named special tokens; other `*_token` keys count when their value is a token.
_STANDARD_NAMES = tuple(f"{n}_token" for n in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
# The ids jaxrl uses: a missing one must fail at load, not as a wrong id later.
_REQUIRED_NAMES = ("bos_token", "eos_token", "pad_token")


class _Template(NamedTuple):
  name: str
  source: str
  where: str  # a file, or a file and a key: for error messages
  compiled: Any


def load_tokenizer(path: str | os.PathLike, *, revision: str | None = None) -> HFTokenizer:
  """Loads the tokenizer, special ids and chat templates of a pretrained model.

  Args:
    path: a local directory holding tokenizer.json (and usually tokenizer_config.json,
      generation_config.json, chat_template.jinja), or a Hub id such as "Qwen/Qwen3-0.6B".
    revision: a Hub branch, tag or commit; ignored for a local directory.

  Raises:
    jaxrl.hub.PretrainedNotFound: `path` is neither a directory nor a Hub id that could be fetched.
    TokenizerError: the tokenizer files are missing or malformed, or a chat template does not
      compile; the message names the directory, file and key.
  """
  # The hf extra, imported on use so that `import jaxrl.data` works without it.
  from tokenizers import Tokenizer as Backend

  directory = resolve_pretrained(os.fspath(path), revision=revision)
  tokenizer_file = os.path.join(directory, TOKENIZER_FILE)
  if not os.path.isfile(tokenizer_file):
    found = [f for f in _UNSUPPORTED_FILES if os.path.exists(os.path.join(directory, f))]
    hint = (
      f" It has {', '.join(found)}, a tokenizer that needs converting first: with transformers,"
      f" AutoTokenizer.from_pretrained(d).save_pretrained(d) writes {TOKENIZER_FILE}."
      if found
      else ""
    )
    raise TokenizerError(
      f"{directory}: no {TOKENIZER_FILE}, the file this loader reads (looked for {TOKENIZER_FILE},"
      f" with {CONFIG_FILE}, {SPECIAL_TOKENS_MAP_FILE}, {GENERATION_CONFIG_FILE} and"
      f" {CHAT_TEMPLATE_FILE} beside it).{hint}"
    )
  try:
    backend = Backend.from_file(tokenizer_file)
  except Exception as e:  # the Rust loader raises plain Exception subclasses
    raise TokenizerError(f"{tokenizer_file}: not a tokenizers file ({e})") from None

  config = _read_json(directory, CONFIG_FILE)
  match_transformers(
    backend,
    _read_text(tokenizer_file),
    tokenizer_file,
    config,
    _read_json(directory, "config.json"),
  )
  named, extras = _special_tokens(directory, config)
  return HFTokenizer(
    backend,
    named_tokens=named,
    extra_special_tokens=extras,
    templates=_chat_templates(directory, config),
    generation_config=_read_json(directory, GENERATION_CONFIG_FILE),
    split_special_tokens=_flag(config, directory, "split_special_tokens"),
    clean_up_tokenization_spaces=_flag(config, directory, "clean_up_tokenization_spaces"),
    source=directory,
  )


class HFTokenizer:
  """A `tokenizers` tokenizer with its special ids, stop ids and chat templates.

  Usually made by `load_tokenizer`. `encode` adds no special tokens; `decode` stops at the first
  stop id and skips special tokens; ids outside the vocabulary decode to U+FFFD.
  """

  def __init__(
    self,
    backend: Any,
    *,
    named_tokens: Mapping[str, str],
    extra_special_tokens: Sequence[str] = (),
    templates: Mapping[str, tuple[str, str]] | None = None,
    generation_config: Mapping[str, Any] | None = None,
    split_special_tokens: bool = False,
    clean_up_tokenization_spaces: bool = False,
    source: str = "<memory>",
  ):
    """Builds the tokenizer from what `load_tokenizer` read.

    Args:
      backend: a `tokenizers.Tokenizer`, changed in place (no padding or truncation, named
        special tokens special).
      named_tokens: e.g. {"eos_token": "<|im_end|>"}; also the chat template's variables.
      extra_special_tokens: more tokens that decode skips.
      templates: template name ("default", "tool_use", ...) to (Jinja source, where it came from).
      generation_config: generation_config.json's contents: `eos_token_id` (an int or a list) and
        `pad_token_id` are read.
      split_special_tokens: encode special-token text as ordinary text.
      clean_up_tokenization_spaces: drop spaces before punctuation (ignored for BPE models).
      source: the directory, for error messages.

    Raises:
      TokenizerError: BOS, EOS or PAD is not in the vocabulary, there is no EOS at all,
        generation_config.json has ids outside the vocabulary, or a template does not compile.
    """
    from tokenizers import AddedToken

    self._backend = backend
    self._source = source
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = bool(split_special_tokens)

    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    self._named = {}
    for name, content in named_tokens.items():
      if backend.token_to_id(content) is None:
        if name in _REQUIRED_NAMES:
          raise TokenizerError(
            f"{source}: {CONFIG_FILE} sets {name} to {content!r}, which is not in {TOKENIZER_FILE}."
          )
        continue  # a token this vocabulary lacks cannot be encoded or decoded anyway
      self._named[name] = content
    for content in [*self._named.values(), *extra_special_tokens]:
      if content not in special and backend.token_to_id(content) is not None:
        backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        special.add(content)
    self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    # Template variables keep every named token, even one this vocabulary lacks.
    self._template_vars = {name: str(content) for name, content in named_tokens.items()}

    vocab = backend.get_vocab(with_added_tokens=True)
    # The highest id + 1, not the number of tokens: a gap in the ids is still a row of the model.
    self._vocab_size = max(vocab.values()) + 1
    self._known = np.zeros(self._vocab_size, dtype=bool)
    self._known[np.fromiter(vocab.values(), dtype=np.int64)] = True

    generation_config = dict(generation_config or {})
    config_eos = self._config_ids(generation_config, "eos_token_id")
    eos = self._id_of("eos_token")
    if eos is None and not config_eos:
      raise TokenizerError(f"{source}: no EOS token in {CONFIG_FILE} or {GENERATION_CONFIG_FILE}")
    self._eos_id = eos = config_eos[0] if eos is None else eos
    # Generation must stop at the model's own end-of-turn ids too (a base tokenizer's EOS is
    # often <|endoftext|> while the chat model ends its turns with <|im_end|>).
    self._stop_ids = tuple(dict.fromkeys([eos, *config_eos]))
    # transformers' tokenizer(text) adds what tokenizer.json's post-processor adds (it ignores
    # add_bos_token then), not the config's bos_token: GPT-2-style configs name one never added.
    self._bos_id = _bos_of_post_processor(backend, source)
    config_pad = self._config_ids(generation_config, "pad_token_id")
    pad = self._id_of("pad_token")
    self._pad_id = pad if pad is not None else (config_pad[0] if config_pad else eos)
    self._clean_up = bool(clean_up_tokenization_spaces) and type(backend.model).__name__ != "BPE"
    self._stop_array = np.asarray(self._stop_ids, dtype=np.int64)

    self._templates = {name: _compile(name, *t) for name, t in (templates or {}).items()}

  @property
  def vocab_size(self) -> int:
    """The highest token id + 1 (base vocabulary and added tokens); embeddings may be larger."""
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    """The id the original puts before a plain text (tokenizer.json's post-processor, as in
    transformers' `tokenizer(text)`), or None where it puts none (Qwen; GPT-2, whose config
    names a bos_token that is never added: see `special_tokens`)."""
    return self._bos_id

  @property
  def eos_id(self) -> int:
    """The tokenizer's EOS (tokenizer_config.json's eos_token); see also `stop_ids`."""
    return self._eos_id

  @property
  def pad_id(self) -> int:
    """The pad token; without one, generation_config.json's pad_token_id, else `eos_id`."""
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """`eos_id` first, then generation_config.json's eos_token_id(s): generation ends at any."""
    return self._stop_ids

  @property
  def special_tokens(self) -> dict[str, str]:
    """Named special tokens in the vocabulary, e.g. {"eos_token": "<|endoftext|>", ...}."""
    return dict(self._named)

  @property
  def chat_templates(self) -> dict[str, str]:
    """Template name to Jinja source; empty for a model without a chat template."""
    return {name: t.source for name, t in self._templates.items()}

  def token_to_id(self, token: str) -> int | None:
    """The id of `token` (e.g. "<|im_end|>"), or None if it is not in the vocabulary."""
    return self._backend.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    """Returns the ids of `text`, without BOS, EOS or any other special token added."""
    return self._backend.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    """Returns the text of `ids` up to the first stop id, without special tokens.

    Ids outside the vocabulary (a model's embedding table is often padded beyond it) decode to
    U+FFFD. Where PAD is also a stop id (Qwen), decoding stops at PAD too, so decode completions
    (right-padded), not left-padded prompts.
    """
    ids_n = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), np.int64).reshape(-1)
    stops = np.flatnonzero(np.isin(ids_n, self._stop_array))
    if stops.size:
      ids_n = ids_n[: stops[0]]
    known = (ids_n >= 0) & (ids_n < self._vocab_size)
    known[known] = self._known[ids_n[known]]
    if known.all():
      return self._clean_up_spaces(self._backend.decode(ids_n.tolist(), skip_special_tokens=True))
    # The backend drops unknown ids. Its decoder gets U+FFFD in their place, all in one pass, so
    # that the text around them is as without them (decoding the pieces between apart would
    # lose the space of a word after one: sentencepiece decoders strip a first token's).
    tokens = [
      self._backend.id_to_token(i) if ok else "\ufffd"
      for i, ok in zip(ids_n.tolist(), known.tolist(), strict=True)
      if not ok or i not in self._special_ids
    ]
    decoder = self._backend.decoder
    return self._clean_up_spaces(decoder.decode(tokens) if decoder else " ".join(tokens))

  def _clean_up_spaces(self, text: str) -> str:
    if self._clean_up:
      for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text

  def render_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
  ) -> str:
    """Renders `messages` with the model's chat template, as transformers does.

    Args:
      messages: dicts with "role" and "content" (and whatever else the template reads, e.g.
        "reasoning_content" or "tool_calls").
      add_generation_prompt: end with the header of an assistant turn, for the model to answer.
      tools: JSON schemas of the tools the model may call (the "tool_use" template, if any,
        is used when this is not None).
      documents: retrieved documents, for templates that render them.
      **template_kwargs: more template variables, e.g. `enable_thinking=False` for Qwen3.

    Raises:
      TokenizerError: the model has no chat template, `messages` is empty, or the template
        raised (e.g. its `raise_exception` on an unsupported role); names the template's file.
      TypeError: a message or a tool is not a dict.
    """
    template = self._pick_template(tools)
    if not messages:
      raise TokenizerError("cannot apply a chat template to an empty list of messages")
    for item in [*messages, *(tools or ())]:
      if not isinstance(item, Mapping):
        raise TypeError(
          f"chat messages and tools must be dicts, got {item!r} (for a tool function, "
          "transformers.utils.get_json_schema(fn) builds its schema)"
        )
    chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
    variables = {**self._template_vars, **plain(template_kwargs)}
    try:
      return template.compiled.render(
        messages=alias_reasoning(plain(chat)),
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **variables,
      )
    except Exception as e:  # a template is code: any error in it is the template's
      raise TokenizerError(
        f"the chat template {template.name!r} from {template.where} failed: {type(e).__name__}: {e}"
      ) from e

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
  ) -> list[int]:
    """Returns the ids of `render_chat_template(...)`: the template writes every special token.

    Takes the arguments of `render_chat_template` (`tools`, `documents`, template variables).
    """
    return self.encode(self.render_chat_template(messages, add_generation_prompt, **kwargs))

  def _pick_template(self, tools) -> _Template:
    if tools is not None and "tool_use" in self._templates:
      return self._templates["tool_use"]
    if "default" in self._templates:
      return self._templates["default"]
    if self._templates:
      raise TokenizerError(f"{self._source}: none of {sorted(self._templates)} is 'default'")
    raise TokenizerError(
      f"{self._source}: no chat template (looked for {CHAT_TEMPLATE_FILE} and the "
      f"'chat_template' key of {CONFIG_FILE}); this looks like a base model: format prompts "
      "yourself and use encode()."
    )

  def _id_of(self, name: str) -> int | None:
    content = self._named.get(name)
    return None if content is None else self._backend.token_to_id(content)

  def _config_ids(self, generation_config: Mapping[str, Any], key: str) -> list[int]:
    value = generation_config.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(type(v) is int and 0 <= v < self._vocab_size for v in values):
      raise TokenizerError(
        f"{self._source}: {GENERATION_CONFIG_FILE} has {key}={value!r}; expected an id or a list "
        f"of ids below the vocabulary size {self._vocab_size}."
      )
    return values

  def __repr__(self) -> str:
    ids = f"bos_id={self._bos_id}, eos_id={self._eos_id}, pad_id={self._pad_id}"
    return f"HFTokenizer({self._source!r}, vocab_size={self._vocab_size}, {ids}, ...)"


# transformers' clean-up, meant for WordPiece-style tokenizers: spaces before punctuation.
_CLEAN_UP = tuple(
  (f" {p}", p.strip()) for p in (".", "?", "!", ",", "' ", "n't", "'m", "'s", "'ve", "'re")
)


def _bos_of_post_processor(backend: Any, source: str) -> int | None:
  """The id tokenizer.json's post-processor puts before a text: its BOS, or None."""
  text_ids = backend.encode("a", add_special_tokens=False).ids
  ids = backend.encode("a", add_special_tokens=True).ids
  start = next(k for k in range(len(ids) + 1) if ids[k : k + len(text_ids)] == text_ids)
  if start > 1:
    raise TokenizerError(
      f"{source}: the post-processor of {TOKENIZER_FILE} puts {start} ids before a text "
      f"({ids[:start]}); jaxrl supports one BOS at most."
    )
  return ids[0] if start else None


def _read_json(directory: str, name: str) -> dict:
  """The JSON object in `directory/name`, or {} when the file does not exist."""
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def _read_text(path: str) -> str:
  try:
    return Path(path).read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise TokenizerError(f"{path}: not UTF-8 text ({e}); save it as UTF-8") from None


def _flag(config: Mapping[str, Any], directory: str, key: str) -> bool:
  value = config.get(key, False)
  if not isinstance(value, bool):
    raise TokenizerError(f"{os.path.join(directory, CONFIG_FILE)}: {key} must be true or false")
  return value


def _token_text(value: Any, where: str) -> str | None:
  """The text of a special token: a string, or a serialised AddedToken {"content": ...}."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")


def _special_tokens(directory: str, config: dict) -> tuple[dict[str, str], list[str]]:
  """Named special tokens (name -> text) and extra special tokens, as transformers 5 reads them."""
  config_path = os.path.join(directory, CONFIG_FILE)
  named: dict[str, str | None] = {}
  extras: list[str] = []

  def add(source: Mapping[str, Any], path: str) -> None:
    for key, value in source.items():
      if key in _EXTRA_LIST_KEYS and isinstance(value, list):
        for i, token in enumerate(value):
          text = _token_text(token, f"{path}: {key}[{i}]")
          if text is not None and text not in extras:
            extras.append(text)
      elif key == "extra_special_tokens" and isinstance(value, Mapping):
        for name, token in value.items():
          named[name] = _token_text(token, f"{path}: {key}.{name}")
      elif key in _STANDARD_NAMES or (key.endswith("_token") and isinstance(value, str | Mapping)):
        named[key] = _token_text(value, f"{path}: {key}")

  add(config, config_path)
  if "added_tokens_decoder" not in config:
    add(
      _read_json(directory, SPECIAL_TOKENS_MAP_FILE),
      os.path.join(directory, SPECIAL_TOKENS_MAP_FILE),
    )
  return {k: v for k, v in named.items() if v is not None}, extras


def _chat_templates(directory: str, config: dict) -> dict[str, tuple[str, str]]:
  """Template name -> (source, where): the .jinja files if any, else tokenizer_config.json's."""
  templates = {}
  path = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    templates["default"] = (_read_text(path), path)
  extra_dir = os.path.join(directory, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        file = os.path.join(extra_dir, name)
        templates[name.removesuffix(".jinja")] = (_read_text(file), file)
  if templates:
    return templates
  config_path = os.path.join(directory, CONFIG_FILE)
  value = config.get("chat_template")
  if value is None:
    return {}
  if isinstance(value, str):
    return {"default": (value, f"{config_path} (key 'chat_template')")}
  if isinstance(value, list):
    for i, entry in enumerate(value):
      name, text = (
        entry.get(k) if isinstance(entry, Mapping) else None for k in ("name", "template")
      )
      if not (isinstance(name, str) and isinstance(text, str)):
        raise TokenizerError(f"{config_path}: chat_template[{i}] must be {{'name', 'template'}}")
      templates[name] = (text, f"{config_path} (key 'chat_template', name {name!r})")
    return templates
  raise TokenizerError(
    f"{config_path}: chat_template must be a string or a list of {{'name', 'template'}}, "
    f"got {type(value).__name__}"
  )


def _compile(name: str, text: str, where: str) -> _Template:
  import jinja2

  try:
    compiled = environment().from_string(text)
  except jinja2.TemplateSyntaxError as e:
    raise TokenizerError(
      f"the chat template from {where} does not compile: line {e.lineno}: {e}"
    ) from None
  return _Template(name, text, where, compiled)
