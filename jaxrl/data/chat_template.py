"""The Jinja environment chat templates render in, and the plain data they are given.

Restated from transformers 5 (`transformers.utils.chat_template_utils`) so that a template renders
here as there: an immutable sandbox with trim_blocks, lstrip_blocks and loop controls; a `tojson`
that keeps non-ASCII and escapes no HTML; `raise_exception`, `strftime_now`, a restricted `dict`
and `namespace`; `{% generation %}` rendered as its body. `jaxrl.data.hf_tokenizer` compiles and
renders the templates; tests/data/hf_tokenizer_test.py compares the results with transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import numpy as np

MIN_JINJA = (3, 1, 6)  # older releases have known sandbox escapes; templates are untrusted


@functools.cache
def environment():
  """The Jinja environment transformers renders chat templates in, built once."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
  if version < MIN_JINJA:
    raise ImportError(
      f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA))} (older releases have known "
      f"sandbox escapes), found {jinja2.__version__}: pip install -U jinja2"
    )

  class GenerationTag(jinja2.ext.Extension):
    # `{% generation %}` marks assistant text for loss masks; rendering keeps its body.
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    # Refuses underscore names: they are the way into Python's internals.
    def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature, so `self=` stays a key
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for key in attrs:
        Namespace._check(key)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key, value):
      Namespace._check(key)
      jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key):
      if isinstance(key, str) and key.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} starts with '_'")

  class DictFactory:
    # `dict(...)` and `dict.fromkeys(...)` without the rest of the type's attributes.
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own filter escapes <, >, & and ' for HTML, which would change the model's prompt.
    return json.dumps(
      value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals.update(
    raise_exception=raise_exception,
    strftime_now=lambda fmt: datetime.now().strftime(fmt),
    dict=DictFactory(),
    namespace=Namespace,
  )
  return env


# The names a message's reasoning comes under; templates read the first (gpt-oss: "thinking").
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(chat: list[dict]) -> list[dict]:
  out = []
  for message in chat:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


def plain(value: Any) -> Any:
  """A copy of `value` made of JSON types only: what a sandboxed template may safely touch.

  Subclasses (enums, numpy scalars) lose their extra methods; other objects (arrays, images)
  become a placeholder naming their type, which templates only test for presence.
  """
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, np.generic):
    return plain(value.item())
  for base, to_base in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
    if isinstance(value, base):
      return to_base(value)
  if isinstance(value, Mapping):
    return {plain(k): plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(plain(v) for v in value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  return f"<{type(value).__name__}>"
