"""A prompt record's token ids: the chat template where the tokenizer has one, else plain text.

One place decides how a record becomes the ids the engine is given, for every tokenizer:
- a tokenizer with a chat template (a Hugging Face model's) gets the record's `messages`
  (system prompt and user turn, built by the task) rendered as the original renders them, with
  the assistant's turn opened (`add_generation_prompt`), so the policy answers as it was tuned;
- the project's own tokenizers (char, byte) get BOS followed by the `prompt` text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.data.tokenizer import Tokenizer


def has_chat_template(tokenizer: Tokenizer) -> bool:
  """Whether `tokenizer` renders chat messages (`HFTokenizer` with a template)."""
  return bool(tokenizer.chat_templates)


def renders_chat(tokenizer: Tokenizer, record: Mapping[str, Any]) -> bool:
  """Whether `record`'s prompt is its `messages` through the chat template (else plain text)."""
  return bool(record.get("messages")) and has_chat_template(tokenizer)


def encode_prompt(
  tokenizer: Tokenizer, record: Mapping[str, Any], template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
  """The ids of `record`'s prompt for `tokenizer`.

  Args:
    tokenizer: any `Tokenizer`.
    record: a prompt record with `prompt` (text) and, from tasks that read chat data,
      `messages` (a list of {"role", "content"}).
    template_kwargs: variables for the chat template, e.g. {"enable_thinking": False}.

  Raises:
    ValueError: the record has neither usable `messages` nor `prompt`.
  """
  messages = record.get("messages")
  if renders_chat(tokenizer, record):
    return tokenizer.apply_chat_template(messages, True, **dict(template_kwargs or {}))
  if "prompt" not in record:
    raise ValueError(
      f"prompt record {record.get('id', '?')!r} has no 'prompt' text"
      + (" and the tokenizer has no chat template for its 'messages'." if messages else ".")
    )
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  return [*bos, *tokenizer.encode(record["prompt"])]
