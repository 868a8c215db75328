"""Tests of the character and byte tokenizers."""

import numpy as np
import pytest

from jaxrl.data import tokenizer as tok


def _random_text(rng: np.random.Generator, alphabet: str, max_len: int = 40) -> str:
  return "".join(rng.choice(list(alphabet), size=int(rng.integers(0, max_len + 1))))


@pytest.mark.parametrize("seed", range(5))
def test_char_round_trip(seed):
  rng = np.random.default_rng(seed)
  t = tok.CharTokenizer()
  for _ in range(50):
    text = _random_text(rng, tok.CHARS)
    ids = t.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < t.vocab_size for i in ids)
    assert t.decode(ids) == text


def test_char_vocabulary_layout():
  t = tok.CharTokenizer()
  assert (t.pad_id, t.bos_id, t.eos_id) == (0, 1, 2)
  assert t.vocab_size == 3 + 20 + 26
  assert t.encode("0") == [3]
  assert t.encode("9+") == [12, 13]
  assert t.encode(" ") == [22]
  assert t.encode("az") == [23, 48]


@pytest.mark.parametrize("name", ["char", "byte"])
def test_decode_skips_specials_and_stops_at_eos(name):
  rng = np.random.default_rng(7)
  t = tok.TOKENIZERS[name]()
  for _ in range(20):
    head, tail = _random_text(rng, tok.CHARS), _random_text(rng, tok.CHARS, 10)
    ids = [t.bos_id] + t.encode(head)
    # PAD may sit anywhere in a generated row; it is skipped, not treated as an end.
    ids.insert(int(rng.integers(0, len(ids) + 1)), t.pad_id)
    ids += [t.eos_id] + t.encode(tail) + [t.pad_id] * 3
    assert t.decode(ids) == head
    assert t.decode(np.asarray(ids, np.int32)) == head


@pytest.mark.parametrize("bad", ["A", "\n", "é", "!", "."])
def test_char_unknown_character(bad):
  rng = np.random.default_rng(ord(bad))
  text = _random_text(rng, tok.CHARS, 20)
  position = int(rng.integers(0, len(text) + 1))
  text = text[:position] + bad + text[position:]
  with pytest.raises(ValueError) as e:
    tok.CharTokenizer().encode(text)
  message = str(e.value)
  assert repr(bad) in message
  assert f"position {position}" in message
  assert "ByteTokenizer" in message


@pytest.mark.parametrize("name", ["char", "byte"])
def test_decode_marks_ids_outside_vocabulary(name):
  t = tok.TOKENIZERS[name]()
  text = t.decode([t.bos_id, *t.encode("12"), t.vocab_size + 3, *t.encode("3")])
  assert text == "12\ufffd3"


@pytest.mark.parametrize("seed", range(3))
def test_byte_round_trip(seed):
  rng = np.random.default_rng(seed)
  t = tok.ByteTokenizer()
  alphabet = tok.CHARS + "ABCXYZ.!?\n\t$€é中😀"
  for _ in range(50):
    text = _random_text(rng, alphabet)
    ids = t.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(3 <= i < 259 for i in ids)
    assert t.decode(ids) == text
  assert t.vocab_size == 259


def test_byte_decode_invalid_utf8_does_not_raise():
  t = tok.ByteTokenizer()
  ids = [0xFF + 3, *t.encode("ok")]
  assert t.decode(ids) == "\ufffdok"


def test_protocol_and_registry():
  assert set(tok.TOKENIZERS) == {"char", "byte"}
  for cls in tok.TOKENIZERS.values():
    assert isinstance(cls(), tok.Tokenizer)
