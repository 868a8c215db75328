"""The countdown task's checker: evaluates an arithmetic expression without `eval`."""

import re

_MAX_EXPRESSION_CHARS = 256
_MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*([0-9]+|[-+*()])")


def evaluate_countdown(expression: str, numbers: list[int]) -> int:
  """Evaluates a countdown expression without `eval`.

  Grammar: integers, binary `+ - *`, parentheses and whitespace; no unary minus. Each integer
  must be one of `numbers`, used at most as often as it occurs there.

  Raises:
    ValueError: the expression is malformed or uses a number it may not; the message says why.
  """
  if len(expression) > _MAX_EXPRESSION_CHARS:
    raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
  tokens, i = [], 0
  while (match := _TOKEN.match(expression, i)) is not None:
    tokens.append(match.group(1))
    i = match.end()
  if expression[i:].strip():
    i += len(expression[i:]) - len(expression[i:].lstrip())
    raise ValueError(
      f"character {expression[i]!r} at position {i} is not allowed; use digits, + - * ( )"
    )
  available = list(numbers)
  pos = 0

  def peek() -> str | None:
    return tokens[pos] if pos < len(tokens) else None

  def parse_sum(depth: int) -> int:
    nonlocal pos
    value = parse_product(depth)
    while peek() in ("+", "-"):
      op = tokens[pos]
      pos += 1
      rhs = parse_product(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def parse_product(depth: int) -> int:
    nonlocal pos
    value = parse_atom(depth)
    while peek() == "*":
      pos += 1
      value *= parse_atom(depth)
    return value

  def parse_atom(depth: int) -> int:
    nonlocal pos
    token = peek()
    if token == "(":
      if depth >= _MAX_DEPTH:
        raise ValueError(f"parentheses nested deeper than {_MAX_DEPTH}")
      pos += 1
      value = parse_sum(depth + 1)
      if peek() != ")":
        raise ValueError("unbalanced parentheses: expected ')'")
      pos += 1
      return value
    if token is None or not token[0].isdigit():
      raise ValueError(f"expected a number or '(' at token {pos}, got {token!r}")
    pos += 1
    value = int(token)
    if value not in available:
      raise ValueError(f"number {value} is not among {list(numbers)} or is used too often")
    available.remove(value)
    return value

  value = parse_sum(0)
  if pos != len(tokens):
    raise ValueError(f"unexpected {tokens[pos]!r} at token {pos}")
  return value
