"""Tokenizers for the synthetic tasks (characters) and for free text (UTF-8 bytes).

Both share the special ids PAD=0, BOS=1, EOS=2. `encode` never adds BOS or EOS: the caller
decides where a sequence starts and stops. `decode` skips PAD and BOS and stops at the first EOS,
so it can be applied to a padded, generated row as is.
"""

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Order is part of the format: a checkpoint trained with this vocabulary relies on these ids.
# Id of CHARS[i] is NUM_SPECIAL + i.
CHARS = "0123456789+-*/=(),: abcdefghijklmnopqrstuvwxyz"


class TokenizerError(ValueError):
  """Tokenizer files that cannot be read, or a chat template that fails; names the file/key."""


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of jaxrl needs from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int | None:
    """The id a plain-text prompt starts with; None for models without one (Qwen)."""
    ...

  @property
  def eos_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every id that ends a response (EOS and the model's other end-of-turn ids)."""
    ...

  @property
  def chat_templates(self) -> dict[str, str]:
    """Chat templates by name ({} for a tokenizer without one)."""
    ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class _Specials:
  """The special ids shared by both tokenizers."""

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def bos_id(self) -> int:
    return BOS_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (EOS_ID,)

  @property
  def chat_templates(self) -> dict[str, str]:
    return {}


def _content_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
  """Ids before the first EOS, without PAD and BOS.

  Ids past the tokenizer's vocabulary (a model's embedding table is often padded beyond it, and
  a sampler can pick those rows) come back as -1, which decoders render as U+FFFD: visible in
  the text and never a valid answer.
  """
  out = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    if i in (PAD_ID, BOS_ID):
      continue
    out.append(i if 0 <= i < vocab_size else -1)
  return out


class CharTokenizer(_Specials):
  """One id per character of a small fixed alphabet.

  Ids: 0 PAD, 1 BOS, 2 EOS, then `0123456789+-*/=(),: ` (ending with a space) and `a`-`z`, in
  that order, from id 3 (vocabulary size 49). Enough for the arithmetic, digit_sort and
  countdown tasks; use `ByteTokenizer` for free text.
  """

  def __init__(self):
    self._to_id = {c: NUM_SPECIAL + i for i, c in enumerate(CHARS)}

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + len(CHARS)

  def encode(self, text: str) -> list[int]:
    """Returns one id per character of `text`, without BOS or EOS.

    Raises:
      ValueError: a character is not in the alphabet.
    """
    try:
      return [self._to_id[c] for c in text]
    except KeyError:
      position = next(i for i, c in enumerate(text) if c not in self._to_id)
      raise ValueError(
        f"CharTokenizer cannot encode {text[position]!r} at position {position} of {text!r}: "
        f"its alphabet is {CHARS!r}. Use ByteTokenizer (tokenizer 'byte') for free text."
      ) from None

  def decode(self, ids: Iterable[int]) -> str:
    """Returns the text of `ids`, skipping PAD and BOS and stopping at the first EOS."""
    return "".join(
      CHARS[i - NUM_SPECIAL] if i >= 0 else "\ufffd" for i in _content_ids(ids, self.vocab_size)
    )


class ByteTokenizer(_Specials):
  """One id per UTF-8 byte: byte b has id b + 3 (vocabulary size 259)."""

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + 256

  def encode(self, text: str) -> list[int]:
    """Returns one id per UTF-8 byte of `text`, without BOS or EOS."""
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]

  def decode(self, ids: Iterable[int]) -> str:
    """Returns the text of `ids`, skipping PAD and BOS and stopping at the first EOS.

    Byte sequences that are not valid UTF-8 (a model can generate them) decode to U+FFFD.
    """
    # An out-of-vocabulary id becomes a lone continuation byte, which decodes to U+FFFD.
    data = bytes(i - NUM_SPECIAL if i >= 0 else 0x80 for i in _content_ids(ids, self.vocab_size))
    return data.decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type[CharTokenizer] | type[ByteTokenizer]] = {
  "char": CharTokenizer,
  "byte": ByteTokenizer,
}
