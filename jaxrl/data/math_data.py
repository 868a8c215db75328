"""Math problems from JSONL, Parquet or Arrow files: rows, gold answers and prompt records.

A source is a `.jsonl`, `.parquet` or `.arrow` file, or a directory searched recursively for
them (in sorted order), as `datasets`' `to_parquet`/`save_to_disk` and the Hugging Face Hub
leave them (`data/train-00000-of-00002.parquet`, `train/data-00000-of-00001.arrow`). In a
directory, a file whose path has a part named `train...` or `test...` belongs to that split.

A row's gold answer is read in one of `ANSWER_FORMATS`: "gsm8k" (the text after the last
`####`, as in `... #### 1,000`), "boxed" (the last `\\boxed{...}` of a MATH-style solution),
"plain" (the field is the answer; numbers are allowed) or "auto" (gsm8k if the text has `####`,
boxed if it has a box, else plain). The task then checks that math-verify parses every gold
answer, so that a bad row fails here, with its file and line, not as a reward of 0 later.
"""

import decimal
import hashlib
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxrl.data.gsm8k import DatasetError, iter_jsonl
from jaxrl.data.verify import last_boxed

SOURCE_SUFFIXES = (".jsonl", ".parquet", ".arrow")
ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "plain")
ROLES = ("system", "user", "assistant")
_SPLIT_PART = re.compile(r"(train|test)(?![a-z])", re.IGNORECASE)


def source_files(path: str) -> list[tuple[str, str | None]]:
  """The data files of `path` with the split their path names, or None.

  Raises:
    DatasetError: a directory without data files, or a file of another kind.
  """
  if os.path.isfile(path):
    if not path.endswith(SOURCE_SUFFIXES):
      raise DatasetError(f"{path}: not a data file; use one of {list(SOURCE_SUFFIXES)}.")
    return [(path, None)]
  files = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    files += [os.path.join(root, n) for n in sorted(names) if n.endswith(SOURCE_SUFFIXES)]
  if not files:
    raise DatasetError(f"{path}: no {', '.join(SOURCE_SUFFIXES)} files in this directory.")
  return [(f, _split_of_file(os.path.relpath(f, path))) for f in files]


def _split_of_file(relative_path: str) -> str | None:
  for part in relative_path.split(os.sep):
    match = _SPLIT_PART.match(part)
    if match:
      return match.group(1).lower()
  return None


def read_rows(
  file: str, required: dict[str, str], optional: Sequence[str] = ()
) -> Iterator[tuple[str, dict[str, Any]]]:
  """Yields (where, row) for each row of a data file; `where` is `file:line` or `file: row i`.

  Args:
    file: a `.jsonl`, `.parquet` or `.arrow` file.
    required: the fields every row needs, each with the config key that names it (for the
      message when a Parquet or Arrow file has no such column).
    optional: further columns read from a Parquet or Arrow file if it has them; a JSONL row
      keeps all its fields.

  Raises:
    DatasetError: a file without a required column, or a line that is not a JSON object.
  """
  if file.endswith(".jsonl"):
    for line_number, row in iter_jsonl(file):
      yield f"{file}:{line_number}", row
    return
  table = _read_table(file)
  for field, key in required.items():
    if field not in table.column_names:
      raise DatasetError(
        f"{file}: no column {field!r}; the file has columns {table.column_names}; set {key} "
        "to one of them."
      )
  table = table.select([*required, *(c for c in optional if c in table.column_names)])
  for i, row in enumerate(table.to_pylist()):
    yield f"{file}: row {i}", row


def _read_table(file: str):
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise ImportError(
      f"Reading {file} needs pyarrow: pip install 'jaxrl[hf]' (or 'pyarrow')."
    ) from None
  try:
    if file.endswith(".parquet"):
      return pq.read_table(file)
    with pa.memory_map(file) as source:  # `save_to_disk` writes the Arrow stream format.
      try:
        return pa.ipc.open_stream(source).read_all()
      except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_file(source).read_all()
  except pa.ArrowException as e:
    raise DatasetError(f"{file}: not a readable {file.rsplit('.', 1)[1]} file ({e}).") from None


def gold_answer(value: Any, answer_format: str, where: str, field: str) -> str:
  """The gold final answer's text in a row's answer field.

  Raises:
    DatasetError: the field has no answer in `answer_format`.
  """
  numeric = isinstance(value, int | float) and not isinstance(value, bool)
  if numeric and answer_format in ("auto", "plain"):
    if isinstance(value, float):
      if not math.isfinite(value):
        raise DatasetError(f"{where}: field {field!r} is {value}, not a final answer.")
      # Positional digits: str() writes 1e-05 and 9e+16, which math-verify reads as products
      # with Euler's e, so every correct response would score 0.
      return format(decimal.Decimal(repr(value)), "f")
    return str(value)
  if not isinstance(value, str):
    raise DatasetError(f"{where}: field {field!r} must be a string, got {type(value).__name__}.")
  if answer_format == "auto":
    boxed = any(box in value for box in ("\\boxed", "\\fbox"))
    answer_format = "gsm8k" if "####" in value else "boxed" if boxed else "plain"
  if answer_format == "gsm8k":
    lines = value.rsplit("####", 1)[1].strip().splitlines() if "####" in value else []
    if not lines:
      raise DatasetError(
        f"{where}: field {field!r} has no final line '#### <answer>' (it ends with "
        f"{value[-40:]!r}); GSM8K solutions end with e.g. '#### 72'."
      )
    return lines[0].strip()
  if answer_format == "boxed":
    answer = last_boxed(value)
    if answer is None or not answer.strip():
      raise DatasetError(
        f"{where}: field {field!r} has no closed, non-empty \\boxed{{...}} (it ends with "
        f"{value[-40:]!r}); MATH solutions box their final answer."
      )
    return answer.strip()
  if not value.strip():
    raise DatasetError(f"{where}: field {field!r} is empty.")
  return value.strip()


def _check_present(row: dict[str, Any], where: str, field: str, key: str) -> None:
  if field not in row:
    raise DatasetError(
      f"{where}: missing field {field!r}; the row has fields {sorted(row)} ({key} names the "
      "field to read)."
    )
  if row[field] is None:
    raise DatasetError(f"{where}: field {field!r} is null.")


def _string(row: dict[str, Any], where: str, field: str) -> str:
  _check_present(row, where, field, "config.task.question_field")
  if not isinstance(row[field], str):
    raise DatasetError(
      f"{where}: field {field!r} must be a string, got {type(row[field]).__name__}."
    )
  return row[field]


def _messages(row: dict[str, Any], where: str, field: str) -> list[dict[str, str]]:
  _check_present(row, where, field, "config.task.messages_field")
  messages = row[field]
  hint = 'a list of {"role": "system" | "user" | "assistant", "content": str}'
  if not isinstance(messages, list) or not messages:
    raise DatasetError(f"{where}: field {field!r} must be {hint}, got {messages!r:.80}.")
  for i, m in enumerate(messages):
    ok = isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
    if not ok:
      raise DatasetError(f"{where}: field {field!r}, message {i}: {m!r:.80} is not {hint}.")
  if messages[-1]["role"] != "user":
    # A trailing assistant turn is usually the solution: prompting with it would leak it.
    raise DatasetError(
      f"{where}: field {field!r} ends with a message of role {messages[-1]['role']!r}; a "
      "prompt ends with the user's turn (drop a trailing answer from the data)."
    )
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def make_record(
  row: dict[str, Any],
  where: str,
  *,
  question_field: str,
  answer_field: str,
  messages_field: str,
  answer_format: str,
  system_prompt: str,
  instruction: str,
) -> dict[str, Any]:
  """A prompt record from a row: `{"id", "prompt", "messages", "answer", "question"}`.

  With `messages_field`, the row's messages are the chat prompt as they are (the system prompt
  goes first if they have none), `question` is the last user message and `prompt` the
  non-system messages joined by blank lines. Otherwise the user message and `prompt` are the
  question followed by `instruction`. `prompt` never has the system prompt: it is for
  tokenizers without a chat template. A row's `id` field, when present, is the record's id.

  Raises:
    DatasetError: a missing or malformed field, or an answer not in `answer_format`.
  """
  system = [{"role": "system", "content": system_prompt}] if system_prompt else []
  if messages_field:
    messages = _messages(row, where, messages_field)
    question = messages[-1]["content"]
    prompt = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    if messages[0]["role"] != "system":
      messages = system + messages
  else:
    question = _string(row, where, question_field)
    prompt = question + instruction
    messages = [*system, {"role": "user", "content": prompt}]
  _check_present(row, where, answer_field, "config.task.answer_field")
  answer = gold_answer(row[answer_field], answer_format, where, answer_field)
  key = problem_key(question)
  record_id = row.get("id")
  return {
    "id": str(record_id) if record_id is not None else "math-" + _digest(key),
    "prompt": prompt,
    "messages": messages,
    "answer": answer,
    "question": question,
  }


def problem_key(question: str) -> str:
  """The canonical form of a question: equal keys are the same problem."""
  return " ".join(question.split())


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def load_records(
  path: str,
  *,
  check_answers: Callable[[list[str]], list[str | None]],
  question_field: str,
  answer_field: str,
  messages_field: str,
  answer_format: str,
  system_prompt: str,
  instruction: str,
) -> dict[str | None, list[dict[str, Any]]]:
  """Reads every record of `path`, grouped by the split its files name (None: no split).

  Args:
    path: a data file or a directory of them.
    check_answers: returns, for a list of gold answers, None for each that math-verify parses
      and the reason for each that it does not (`VerifierPool.check_answers`).
    question_field, answer_field, messages_field, answer_format, system_prompt, instruction:
      as in `make_record`.

  Raises:
    DatasetError: a malformed row, or a gold answer that does not parse; the message names the
      file, the line or row, and the field.
  """
  fields = dict(
    question_field=question_field,
    answer_field=answer_field,
    messages_field=messages_field,
    answer_format=answer_format,
    system_prompt=system_prompt,
    instruction=instruction,
  )
  prompt_key = "config.task." + ("messages_field" if messages_field else "question_field")
  required = {
    messages_field or question_field: prompt_key,
    answer_field: "config.task.answer_field",
  }
  by_split: dict[str | None, list[dict[str, Any]]] = {}
  records, wheres = [], []
  for file, split in source_files(path):
    before = len(records)
    for where, row in read_rows(file, required, optional=["id"]):
      records.append(make_record(row, where, **fields))
      wheres.append(where)
    by_split.setdefault(split, []).extend(records[before:])
  if not records:
    raise DatasetError(f"{path}: no rows.")
  reasons = check_answers([r["answer"] for r in records])
  bad = [i for i, reason in enumerate(reasons) if reason is not None]
  if bad:
    i = bad[0]
    more = f" ({len(bad) - 1} more rows have the same problem)" if len(bad) > 1 else ""
    raise DatasetError(
      f"{wheres[i]}: field {answer_field!r}: math-verify cannot parse the gold answer "
      f"{records[i]['answer']!r} ({reasons[i]}){more}; fix the data or set "
      f"config.task.answer_format (now {answer_format!r})."
    )
  return by_split
