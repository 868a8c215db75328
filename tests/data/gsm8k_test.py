"""Tests of the GSM8K-style loader, answer extraction, reward and task."""

import json

import numpy as np
import pytest

from jaxrl.data import gsm8k, tasks


def _invented_rows(rng: np.random.Generator, n: int) -> list[dict]:
  """Invented word problems in the GSM8K format (not taken from any dataset)."""
  rows = []
  for i in range(n):
    a, b = int(rng.integers(2, 900)), int(rng.integers(2, 900))
    question = f"Ana has {a} shells. She finds {b} more on day {i}. How many shells does she have?"
    answer = f"Ana has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} shells.\n#### {a + b:,}"
    rows.append({"question": question, "answer": answer, "source": "invented"})
  return rows


def _write(path, rows, blank_every: int = 0) -> None:
  lines = []
  for i, row in enumerate(rows):
    lines.append(row if isinstance(row, str) else json.dumps(row))
    if blank_every and i % blank_every == 0:
      lines.append("   ")
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_load_jsonl_skips_blank_lines_and_keeps_fields(tmp_path):
  rows = _invented_rows(np.random.default_rng(0), 25)
  path = tmp_path / "train.jsonl"
  _write(path, rows, blank_every=4)
  assert gsm8k.load_jsonl(path) == rows


@pytest.mark.parametrize(
  ("bad_line", "expected"),
  [
    ('{"question": "q"', "invalid JSON"),
    ('{"question": "q", "explanation": "x"}', "missing field 'answer'.*'explanation', 'question'"),
    ('{"answer": "#### 1"}', "missing field 'question'.*\\['answer'\\]"),
    ('["q", "a"]', "expected a JSON object"),
    ('{"question": "q", "answer": 5}', "'answer' must be a string"),
  ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, bad_line, expected):
  rng = np.random.default_rng(len(bad_line))
  rows = _invented_rows(rng, 10)
  bad_index = int(rng.integers(0, 10))
  lines = [json.dumps(r) for r in rows]
  lines.insert(bad_index, bad_line)
  lines.insert(0, "")  # a blank first line still counts as line 1.
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines), encoding="utf-8")
  with pytest.raises(gsm8k.DatasetError, match=expected) as e:
    gsm8k.load_jsonl(path)
  assert str(e.value).startswith(f"{path}:{bad_index + 2}: ")
  assert isinstance(e.value, ValueError)


def test_load_jsonl_reads_a_byte_order_mark_and_names_a_line_that_is_not_utf8(tmp_path):
  rows = _invented_rows(np.random.default_rng(3), 3)
  path = tmp_path / "bom.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8-sig")
  assert gsm8k.load_jsonl(path) == rows
  lines = [json.dumps(r).encode() for r in rows]
  lines[1] = lines[1].replace(b"Ana", b"An\xe1")  # Latin-1, not UTF-8
  path.write_bytes(b"\n".join(lines))
  with pytest.raises(gsm8k.DatasetError, match=f"^{path}:2: not UTF-8 text: .* at byte"):
    gsm8k.load_jsonl(path)


@pytest.mark.parametrize(
  ("text", "expected"),
  [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("Total 12 boxes\n#### 1,000", "1000"),
    ("#### -15", "-15"),
    ("#### $2,500.75 in total", "2500.75"),
    ("First 10 then 20, so the answer is 72.", "72"),
    ("It costs $1,234.50.", "1234.50"),
    ("The temperature fell to -3.5 degrees", "-3.5"),
    ("7-5 leaves 2", "2"),
    ("so 7-5", "5"),
    ("The answer is -$40", "-40"),
    ("counts 1,2,3", "3"),
    ("#### .5", "0.5"),  # not "5"
    ("She drank .75 of it", "0.75"),
    ("It is -.5 now", "-0.5"),
    ("version 1.2.3", "3"),  # "1.2" then "3": a "." after a digit starts no number
    ("no digits at all", None),
    ("#### unknown", None),
    ("", None),
  ],
)
def test_extract_final_answer(text, expected):
  assert gsm8k.extract_final_answer(text) == expected


@pytest.mark.parametrize("seed", range(3))
def test_extract_final_answer_random_numbers(seed):
  rng = np.random.default_rng(seed)
  for _ in range(100):
    value = int(rng.integers(-(10**7), 10**7))
    cents = int(rng.integers(0, 100))
    text_value = f"{abs(value):,}" if rng.random() < 0.5 else str(abs(value))
    if rng.random() < 0.5:
      text_value = "$" + text_value
    if rng.random() < 0.5:
      text_value += f".{cents:02d}"
      expected = f"{value}.{cents:02d}"
    else:
      expected = str(value)
    text_value = ("-" if value < 0 else "") + text_value
    distractor = int(rng.integers(0, 1000))
    text = f"We had {distractor} items; after all that the result is {text_value}."
    assert gsm8k.extract_final_answer(text) == expected
    assert gsm8k.reward(expected, text) == 1.0


def test_reward_is_numeric():
  assert gsm8k.reward("72", "so it is 72.0") == 1.0
  assert gsm8k.reward("1000", "It costs $1,000") == 1.0
  assert gsm8k.reward("#### 18", "The answer is 18") == 1.0
  assert gsm8k.reward("72", "so it is 73") == 0.0
  assert gsm8k.reward("72", "72 or maybe 7") == 0.0  # the last number counts.
  assert gsm8k.reward("72", "I do not know") == 0.0
  assert gsm8k.reward("-4", "4") == 0.0
  assert gsm8k.reward("0.5", "so it is .5") == 1.0
  assert gsm8k.reward("5", "so it is .5") == 0.0


@pytest.mark.parametrize(
  ("response", "expected"),
  [
    # A Markdown heading is not a final-answer line: the last number is the answer.
    ("#### Step 1: eggs laid\n16 - 3 - 4 = 9\n#### Step 2: money\n9 * 2 = 18.", "18"),
    ("#### Final answer (2 steps)\nShe makes $18 every day.", "18"),
    ("#### Step 18\nSo she earns 20 dollars.", "20"),
    # A number right after `####` is the answer, as in a reference.
    ("9 * 2 = 18 dollars\n#### 18", "18"),
    ("#### $1,000 in all, from 3 boxes", "1000"),
    ("#### -15 dollars", "-15"),
    # The reasoning is not the answer: only what follows `</think>` counts.
    ("<think>maybe 20? no: 9 * 2 = 18</think>The answer is 18.", "18"),
    ("<think>It could be 18, but I keep going", None),
  ],
)
def test_response_answer(response, expected):
  assert gsm8k.response_answer(response) == expected
  assert gsm8k.reward("18", response) == float(expected == "18")


def test_prompt_records_and_missing_final_answer(tmp_path):
  rows = _invented_rows(np.random.default_rng(1), 5)
  path = tmp_path / "data.jsonl"
  _write(path, rows)
  records = gsm8k.load_prompt_records(path)
  for row, record in zip(rows, records, strict=True):
    assert record["prompt"] == row["question"] + "\nAnswer:"
    assert record["answer"] == row["answer"].split("#### ")[1].replace(",", "")
  rows[3]["answer"] = "It is 5 because 2 + 3 = 5."
  _write(path, rows)
  with pytest.raises(gsm8k.DatasetError, match=f"^{path}:4: .*####"):
    gsm8k.load_prompt_records(path)


@pytest.mark.parametrize(
  ("answer", "gold"),
  [
    ("so 3 + 4 = 7\n#### 7", "7"),
    ("#### $1,000.", "1000"),
    ("#### -3", "-3"),
    ("#### .5", "0.5"),
    ("#### -$0.25\n", "-0.25"),
  ],
)
def test_prompt_records_read_plain_gold_numbers(tmp_path, answer, gold):
  path = tmp_path / "data.jsonl"
  _write(path, [{"question": "q", "answer": answer}])
  (record,) = gsm8k.load_prompt_records(path)
  assert record["answer"] == gold
  assert gsm8k.reward(record["answer"], f"The answer is {gold}.") == 1.0


@pytest.mark.parametrize("gold", ["1/2", "1.5e3", "2 1/2", "1,2", "\\frac{1}{2}", "72 or 73"])
def test_prompt_records_refuse_gold_answers_that_are_not_plain_numbers(tmp_path, gold):
  # Their first number ("1" of "1/2") is not the answer: the task would train towards it.
  rows = _invented_rows(np.random.default_rng(4), 3)
  rows[1]["answer"] = f"Half of it.\n#### {gold}"
  path = tmp_path / "data.jsonl"
  _write(path, rows)
  with pytest.raises(gsm8k.DatasetError, match=f"^{path}:2: .*not a plain number.*'math'"):
    gsm8k.load_prompt_records(path)


def test_gsm8k_task(tmp_path):
  rows = _invented_rows(np.random.default_rng(2), 300)
  path = tmp_path / "gsm.jsonl"
  _write(path, rows)
  task = tasks.make_task(tasks.TaskConfig(name="gsm8k", path=str(path), eval_size=10))
  test_all = task.records("test", num=None)
  assert len(test_all) <= 10
  train = task.records("train", seed=0)
  test = task.records("test", num=300 - len(train))  # every problem is in one split.
  assert not {r["question"] for r in train} & {r["question"] for r in test}
  assert 10 <= len(test) <= 60
  assert task.records("test", 5, seed=1) == task.records("test", 5, seed=9) == test[:5]
  assert train != task.records("train", seed=1)
  assert sorted(r["id"] for r in train) == sorted(r["id"] for r in task.records("train", seed=1))
  for r in test:
    assert task.reward(r, f"Adding them, she has {int(r['answer']):,} shells.") == 1.0
    assert task.reward(r, f"She has {int(r['answer']) + 1} shells.") == 0.0
    assert task.reward(r, "She has many shells.") == 0.0
  assert task.records("test", 301) == test  # more than it has: all of them (warned)
  with pytest.raises(ValueError, match="fewer"):
    task.records("train", 301)
