"""GSM8K-style JSONL: loading, final-answer extraction and the numeric reward.

A row is a JSON object with a `question` and an `answer` string; the reference answer ends with
a line `#### <number>`, as in GSM8K. Nothing is downloaded: point `TaskConfig.path` at a file.

The reward here is numeric and runs in process (the `gsm8k` task). The `math` task reads the
same files (`answer_format="gsm8k"`, also Parquet) and checks answers with math-verify instead.
"""

import fractions
import hashlib
import json
import os
import re
from collections.abc import Iterator

from jaxrl.data.verify import answer_part

REQUIRED_FIELDS = ("question", "answer")
PROMPT_SUFFIX = "\nAnswer:"

# A number with optional sign, dollar sign, thousands commas and decimals: "-$1,000.50", ".5".
# The minus must not follow a word character or ")" so that "7-5" reads as 7 and 5, not -5;
# thousands groups must have exactly three digits so that "1,2,3" reads as three numbers; a
# number without whole digits (".5", read as 0.5, not 5) must not follow a digit or "." so that
# "1.2.3" reads as 1.2 and 3, as before.
_NUMBER = re.compile(
  r"((?<![\w)])-)?\$?([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+|(?<![0-9.])(?=\.[0-9]))(\.[0-9]+)?"
)
_FINAL_MARK = "####"


class DatasetError(ValueError):
  """A malformed dataset file; the message starts with `path:line:` (JSONL) or `path: row i:`
  (Parquet and Arrow, rows counted from 0 in each file)."""


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
  """Yields (line number, object) for each non-blank line of a UTF-8 JSONL file (a byte order
  mark at its start is skipped).

  Raises:
    DatasetError: a line that is not UTF-8 or not a JSON object; the message starts with
      `path:line:`.
  """
  with open(path, "rb") as f:  # decoded a line at a time, so that bad bytes have a line
    for line_number, raw in enumerate(f, start=1):
      try:
        # utf-8-sig on the first line: some editors and exports open UTF-8 with a byte order
        # mark, which is not part of the JSON.
        line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
      except UnicodeDecodeError as e:
        kind = " (it is a Parquet file)" if raw.startswith(b"PAR1") else ""
        raise DatasetError(
          f"{path}:{line_number}: not UTF-8 text{kind}: {e.reason} at byte {e.start} of the "
          "line; a JSONL file is UTF-8 text with one JSON object a line."
        ) from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DatasetError(
          f"{path}:{line_number}: invalid JSON ({e.msg} at column {e.colno})."
        ) from None
      if not isinstance(row, dict):
        raise DatasetError(
          f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}."
        )
      yield line_number, row


def _iter_rows(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
  """Yields (line number, row) for each non-blank line, with the required fields checked."""
  for line_number, row in iter_jsonl(path):
    for field in REQUIRED_FIELDS:
      if field not in row:
        raise DatasetError(
          f"{path}:{line_number}: missing field {field!r}; the row has fields {sorted(row)}; "
          f"every row needs {list(REQUIRED_FIELDS)}."
        )
      if not isinstance(row[field], str):
        raise DatasetError(
          f"{path}:{line_number}: field {field!r} must be a string, "
          f"got {type(row[field]).__name__}."
        )
    yield line_number, row


def load_jsonl(path: str | os.PathLike) -> list[dict]:
  """Reads a JSONL file of rows with string `question` and `answer` fields.

  Blank lines are skipped. Other fields are kept as they are.

  Raises:
    DatasetError: a line is not a JSON object, or lacks a field; the message starts with
      `path:line:`.
  """
  return [row for _, row in _iter_rows(path)]


def _number_text(match: re.Match) -> str:
  sign, whole, frac = match.groups()
  return (sign or "") + (whole.replace(",", "") or "0") + (frac or "")


def gold_number(reference: str) -> str | None:
  """The number of a reference's last `####` line, normalised, or None when that line is not
  a plain number: `"#### $1,000."` gives `"1000"`, `"#### .5"` `"0.5"`; `"#### 1/2"`,
  `"#### 1.5e3"` and `"#### 2 1/2"` give None (their first number is not the answer)."""
  if _FINAL_MARK not in reference:
    return None
  lines = reference.rsplit(_FINAL_MARK, 1)[1].strip().splitlines()
  # A trailing "." ends a sentence ("#### 72.") and is not part of the number.
  match = _NUMBER.fullmatch(lines[0].strip().removesuffix(".")) if lines else None
  return None if match is None else _number_text(match)


def extract_final_answer(text: str) -> str | None:
  """Returns the final numeric answer of a reference, normalised, or None if there is none.

  For a GSM8K reference (with a `#### 72` line) this is the first number after the last `####`;
  otherwise the last number in the text. Thousands commas and `$` are dropped: `"#### $1,000"`
  gives `"1000"`, `"... so -3.5 degrees."` gives `"-3.5"`. A model's response: `response_answer`.
  """
  if _FINAL_MARK in text:
    match = _NUMBER.search(text.rsplit(_FINAL_MARK, 1)[1])
    return None if match is None else _number_text(match)
  return _last_number(text)


def response_answer(text: str) -> str | None:
  """The final numeric answer of a model's response: after its reasoning (`answer_part`), the
  number right after the last `####` where one follows it directly (`"#### 72"`), else the
  last number. A `####` followed by words is a Markdown heading (`"#### Step 2: ..."`), whose
  step number is not the answer."""
  text = answer_part(text)
  if _FINAL_MARK in text:
    match = _NUMBER.match(text.rsplit(_FINAL_MARK, 1)[1].lstrip())
    if match:
      return _number_text(match)
  return _last_number(text)


def _last_number(text: str) -> str | None:
  matches = list(_NUMBER.finditer(text))
  return _number_text(matches[-1]) if matches else None


def numbers_equal(a: str, b: str) -> bool:
  """Whether two decimal strings denote the same number (`"72"` and `"72.0"` do)."""
  return fractions.Fraction(a) == fractions.Fraction(b)


def reward(reference: str, response: str) -> float:
  """1.0 if the response's final number equals the reference answer numerically, else 0.0.

  Args:
    reference: the reference final answer (as in a record's `answer`) or a full reference
      solution ending with `#### <number>`.
    response: the model's generated text.
  """
  ref = extract_final_answer(reference)
  got = response_answer(response)
  if ref is None or got is None:
    return 0.0
  return float(numbers_equal(ref, got))


def problem_id(question: str) -> str:
  """A stable id for a question, from its text."""
  return "gsm8k-" + hashlib.sha256(question.strip().encode("utf-8")).hexdigest()[:16]


def load_prompt_records(path: str | os.PathLike) -> list[dict]:
  """Reads a GSM8K-style JSONL file into prompt records.

  Each record is `{"id", "prompt": question + "\\nAnswer:", "answer": final number,
  "question"}`, in file order. A row's `id` field, when present, is used as the record id.

  Raises:
    DatasetError: a malformed row, or a reference answer whose last `####` is not followed by a
      plain number (`gold_number`).
  """
  records = []
  for line_number, row in _iter_rows(path):
    answer = row["answer"]
    after = answer.rsplit(_FINAL_MARK, 1)[1].strip() if _FINAL_MARK in answer else ""
    if not after:
      raise DatasetError(
        f"{path}:{line_number}: the answer has no final line '#### <number>' "
        f"(answer ends with {answer[-40:]!r}); GSM8K references end with e.g. '#### 72'."
      )
    final = gold_number(answer)
    if final is None:
      # Reading the first number of "1/2" or "1.5e3" would train towards a wrong answer.
      raise DatasetError(
        f"{path}:{line_number}: the answer after '####' is {after.splitlines()[0][:40]!r}, not "
        "a plain number (such as '72', '-3.5', '.5' or '$1,000'), which is all the gsm8k task "
        "compares; for other answers (fractions, expressions) set config.task.name='math' "
        "with config.task.answer_format='gsm8k', which checks them with math-verify."
      )
    records.append(
      {
        "id": str(row.get("id", problem_id(row["question"]))),
        "prompt": row["question"] + PROMPT_SUFFIX,
        "answer": final,
        "question": row["question"],
      }
    )
  return records
