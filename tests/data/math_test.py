"""Tests of the math task: JSONL/Parquet/Arrow reading, gold answers, math-verify rewards."""

import json
import math
import os
import threading
import time

import numpy as np
import pytest

from jaxrl.config import ConfigError, default_config, from_config_dict
from jaxrl.data import math_data, tasks, verify
from jaxrl.data.gsm8k import DatasetError
from jaxrl.data.task_base import split_of
from jaxrl.data.tasks import TaskConfig

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("math_verify")

SAMPLE = os.path.join(os.path.dirname(tasks.__file__), "samples", "math_sample.jsonl")

# A worker that runs the real rule, except on responses that ask it to hang or crash.
_FAULTY_WORKER = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("faulty_verify", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
real = module.answer_is_correct
def answer_is_correct(answer, response):
  if "HANG-SOFT" in response:  # Python code: the worker's alarm interrupts it.
    time.sleep(60)
  if "HANG-HARD" in response:  # as C code that no signal interrupts: the parent must kill it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
    time.sleep(60)
  if "CRASH" in response:
    os._exit(3)
  return real(answer, response)
module.answer_is_correct = answer_is_correct
module._serve(float(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def pool():
  with verify.VerifierPool(num_workers=2, timeout_s=5.0) as p:
    yield p


def _task(pool, path, **overrides) -> tasks.Math:
  return tasks.Math(TaskConfig(name="math", path=str(path), **overrides), verifier=pool)


def _write_jsonl(path, rows) -> None:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _word_rows(rng: np.random.Generator, n: int, start: int = 0) -> list[dict]:
  """Invented GSM8K-style rows, with thousands commas in the final answer."""
  rows = []
  for i in range(start, start + n):
    a, b = int(rng.integers(100, 9000)), int(rng.integers(100, 9000))
    question = f"Crate {i} holds {a} bolts and crate {i + 1} holds {b}. How many bolts in all?"
    rows.append({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"})
  return rows


def _fraction_rows(rng: np.random.Generator, n: int) -> list[dict]:
  """Invented MATH-style rows with a boxed fraction."""
  rows = []
  for i in range(n):
    p, q = int(rng.integers(1, 40)), int(rng.integers(41, 90))
    g = math.gcd(p, q)
    solution = f"Divide by {g}: $\\boxed{{\\frac{{{p // g}}}{{{q // g}}}}}$."
    rows.append({"question": f"Problem {i}: simplify $\\frac{{{p}}}{{{q}}}$.", "answer": solution})
  return rows


# -- the sample file ------------------------------------------------------------------------------


def test_sample_file_loads_and_every_gold_answer_verifies(pool):
  task = _task(pool, SAMPLE)
  records = task.records("train") + task.records("test", num=None)
  with open(SAMPLE, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  assert len(records) == len(rows) >= 60
  assert sum("####" in r["answer"] for r in rows) >= 30
  assert sum("\\boxed" in r["answer"] for r in rows) >= 15
  assert max(len(r["question"]) for r in rows) < 200
  assert pool.check_answers([r["answer"] for r in records]).result() == [None] * len(records)
  boxed = [f"So the answer is $\\boxed{{{r['answer']}}}$." for r in records]
  np.testing.assert_array_equal(task.rewards(records, boxed), np.ones(len(records)))
  assert not task.rewards(records, ["I cannot tell."] * len(records)).any()


def test_more_eval_prompts_than_test_problems_evaluates_on_all_of_them(pool, caplog):
  """configs/grpo_hf.py asks for 128 (a real dataset's eval) and ships a 64-row sample."""
  task = _task(pool, SAMPLE)
  everything = task.records("test", num=None)
  assert task.records("test", num=10_000) == everything
  assert f"config.eval.num_prompts=10000 asks for more test problems than {SAMPLE}" in caplog.text
  with pytest.raises(ValueError, match="train problems, fewer than"):
    task.records("train", num=10_000)


# -- reading --------------------------------------------------------------------------------------


def test_jsonl_records_and_auto_format(pool, tmp_path):
  rng = np.random.default_rng(0)
  rows = _word_rows(rng, 30) + _fraction_rows(rng, 30)
  rows += [{"question": "Plain one?", "answer": 42}, {"question": "Plain two?", "answer": "-3.5"}]
  path = tmp_path / "mixed.jsonl"
  _write_jsonl(path, rows)
  task = _task(pool, path, eval_size=1000, system_prompt="Be brief.")
  records = task.records("train") + task.records("test")
  assert len(records) == len(rows)
  by_question = {r["question"]: r for r in records}
  for row in rows:
    record = by_question[row["question"]]
    assert record["prompt"] == row["question"] + tasks.MATH_INSTRUCTION
    assert record["messages"] == [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": record["prompt"]},
    ]
    if "####" in str(row["answer"]):
      assert record["answer"] == row["answer"].rsplit("#### ", 1)[1]
    elif "\\boxed" in str(row["answer"]):
      assert record["answer"] == verify.last_boxed(row["answer"])
    else:
      assert record["answer"] == str(row["answer"])
  assert len({r["id"] for r in records}) == len(records)
  train = {r["question"] for r in task.records("train", seed=1)}
  assert train == {r["question"] for r in task.records("train", seed=0)}
  assert not train & {r["question"] for r in task.records("test")}


def test_custom_fields_and_formats(pool, tmp_path):
  rng = np.random.default_rng(1)
  rows = [
    {"problem": r["question"], "solution": r["answer"], "id": i}
    for i, r in enumerate(_fraction_rows(rng, 12))
  ]
  path = tmp_path / "custom.jsonl"
  _write_jsonl(path, rows)
  task = _task(
    pool,
    path,
    question_field="problem",
    answer_field="solution",
    answer_format="boxed",
    instruction=" Box it.",
    eval_size=100,
  )
  records = task.records("train") + task.records("test")
  assert sorted(r["id"] for r in records) == sorted(str(i) for i in range(12))
  for record in records:
    row = rows[int(record["id"])]
    assert record["prompt"] == row["problem"] + " Box it."
    assert record["messages"] == [{"role": "user", "content": record["prompt"]}]
    assert record["answer"] == verify.last_boxed(row["solution"])
  # The gsm8k format reads the #### line even when the text has a box too.
  _write_jsonl(path, [{"question": "q", "answer": "\\boxed{1} then 7\n#### 7"}])
  task = _task(pool, path, answer_format="gsm8k")
  assert [r["answer"] for r in task.records("train") + task.records("test")] == ["7"]


def test_messages_field(pool, tmp_path):
  rows = []
  for i in range(10):
    chat = [{"role": "user", "content": f"What is {i} + {i}?"}]
    if i % 2:
      chat = [
        {"role": "system", "content": "Own system."},
        {"role": "user", "content": "Warm-up: 1 + 1?"},
        {"role": "assistant", "content": "2"},
        *chat,
      ]
    rows.append({"chat": chat, "answer": str(2 * i)})
  path = tmp_path / "chat.jsonl"
  _write_jsonl(path, rows)
  task = _task(pool, path, messages_field="chat", system_prompt="Default system.", eval_size=99)
  records = task.records("train") + task.records("test")
  assert len(records) == 10
  for record in records:
    i = int(record["answer"]) // 2
    assert record["question"] == f"What is {i} + {i}?"
    if i % 2:
      assert record["messages"] == rows[i]["chat"]
      assert record["prompt"] == f"Warm-up: 1 + 1?\n\n2\n\nWhat is {i} + {i}?"
    else:
      assert record["messages"] == [
        {"role": "system", "content": "Default system."},
        {"role": "user", "content": f"What is {i} + {i}?"},
      ]
      assert record["prompt"] == f"What is {i} + {i}?"


def _parquet(path, rows) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)


def test_parquet_single_file(pool, tmp_path):
  rng = np.random.default_rng(2)
  rows = [{"id": 100 + i, **r, "extra": 1.5} for i, r in enumerate(_word_rows(rng, 40))]
  path = tmp_path / "one.parquet"
  _parquet(path, rows)
  task = _task(pool, path, eval_size=1000)
  train, test = task.records("train"), task.records("test")
  assert len(train) + len(test) == 40 and test
  assert all(split_of(task.problem_key(r)) == "test" for r in test)
  for record in train + test:
    row = rows[int(record["id"]) - 100]
    assert record["question"] == row["question"]
    assert record["answer"] == row["answer"].rsplit("#### ", 1)[1]


def test_sharded_directory_with_named_splits(pool, tmp_path):
  rng = np.random.default_rng(3)
  train_rows = _word_rows(rng, 30)
  test_rows = _word_rows(rng, 12, start=100)
  data = tmp_path / "ds" / "data"
  _parquet(data / "train-00000-of-00002.parquet", train_rows[:17])
  _parquet(data / "train-00001-of-00002.parquet", train_rows[17:])
  _parquet(data / "test-00000-of-00001.parquet", test_rows)
  (tmp_path / "ds" / "README.md").write_text("not data")
  task = _task(pool, tmp_path / "ds", eval_size=1000)
  assert [r["question"] for r in task.records("test")] == [r["question"] for r in test_rows]
  train = task.records("train", seed=int(rng.integers(100)))
  assert sorted(r["question"] for r in train) == sorted(r["question"] for r in train_rows)


def test_train_rows_whose_problem_is_in_the_test_files_are_dropped(pool, tmp_path, caplog):
  rows = _word_rows(np.random.default_rng(6), 20)
  _write_jsonl(tmp_path / "train.jsonl", rows)
  # The same problems, spaced otherwise: one problem key.
  _write_jsonl(tmp_path / "test.jsonl", [{**r, "question": "  " + r["question"]} for r in rows[:5]])
  task = _task(pool, tmp_path, eval_size=1000)
  with caplog.at_level("WARNING"):
    train = task.records("train")
  assert sorted(r["question"] for r in train) == sorted(r["question"] for r in rows[5:])
  assert len(task.records("test")) == 5
  assert "dropped 5 of 20 train rows whose problem is also in the test files" in caplog.text
  _write_jsonl(tmp_path / "train.jsonl", rows[:5])
  with pytest.raises(DatasetError, match="every one of the 5 train rows .*config.task.path"):
    _task(pool, tmp_path).records("train")


def test_arrow_directory_as_save_to_disk_leaves_it(pool, tmp_path):
  rng = np.random.default_rng(4)
  splits = {"train": _fraction_rows(rng, 9), "test": _word_rows(rng, 5)}
  for split, rows in splits.items():
    (tmp_path / split).mkdir()
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(str(tmp_path / split / "data-00000-of-00001.arrow"), table.schema) as w:
      w.write_table(table)
  task = _task(pool, tmp_path, eval_size=1000)
  for split, rows in splits.items():
    got = sorted(r["question"] for r in task.records(split))
    assert got == sorted(r["question"] for r in rows)


def test_directory_without_split_names_is_hash_split(pool, tmp_path):
  rng = np.random.default_rng(5)
  rows = _word_rows(rng, 60)
  _parquet(tmp_path / "part-0.parquet", rows[:25])
  (tmp_path / "more").mkdir()
  _write_jsonl(tmp_path / "more" / "part-1.jsonl", rows[25:])
  task = _task(pool, tmp_path, eval_size=1000)
  train, test = task.records("train"), task.records("test")
  assert sorted(r["question"] for r in train + test) == sorted(r["question"] for r in rows)
  assert all(split_of(task.problem_key(r)) == "train" for r in train)


# -- bad input ------------------------------------------------------------------------------------

_GOOD_ANSWERS = {
  "auto": "3 + 4 = 7\n#### 7",
  "gsm8k": "#### 7",
  "boxed": "\\boxed{7}",
  "plain": "7",
}


@pytest.mark.parametrize(
  ("bad_row", "overrides", "expected"),
  [
    ({"question": "q"}, {}, "missing field 'answer'"),
    ({"question": 5, "answer": "#### 1"}, {}, "field 'question' must be a string, got int"),
    ({"question": "q", "answer": None}, {}, "field 'answer' is null"),
    ({"question": "q", "answer": "#### ???"}, {}, "field 'answer': math-verify cannot parse"),
    ({"question": "q", "answer": "It is 7."}, {"answer_format": "gsm8k"}, "'answer'.*'#### <"),
    ({"question": "q", "answer": "so \\boxed{7"}, {"answer_format": "boxed"}, "'answer'.*boxed"),
    ({"question": "q", "answer": ""}, {"answer_format": "plain"}, "field 'answer' is empty"),
    ({"question": "q", "answer": ["7"]}, {}, "field 'answer' must be a string, got list"),
    ({"chat": [{"role": "bot", "content": "hi"}], "answer": "1"}, {}, "'chat', message 0"),
    ({"chat": [{"role": "system", "content": "s"}], "answer": "1"}, {}, "role 'system'"),
    (
      {"chat": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]},
      {},
      "'chat' ends with a message of role 'assistant'",
    ),
    ({"chat": "hello", "answer": "1"}, {}, "field 'chat' must be a list"),
    ('{"question": "q", ', {}, "invalid JSON"),
  ],
)
def test_bad_jsonl_rows_name_file_line_and_field(pool, tmp_path, bad_row, overrides, expected):
  rng = np.random.default_rng(len(str(bad_row)))
  answer = _GOOD_ANSWERS[overrides.get("answer_format", "auto")]
  rows = [{"question": f"How many? {i}", "answer": answer} for i in range(int(rng.integers(3, 9)))]
  line = int(rng.integers(0, len(rows) + 1))
  if isinstance(bad_row, dict) and "chat" in bad_row:
    rows = [{"chat": [{"role": "user", "content": r["question"]}], "answer": "7"} for r in rows]
    overrides = {"messages_field": "chat", **overrides}
  rows.insert(line, bad_row)
  path = tmp_path / "bad.jsonl"
  _write_jsonl(path, rows)
  with pytest.raises(DatasetError, match=expected) as e:
    _task(pool, path, **overrides).records("train")
  assert str(e.value).startswith(f"{path}:{line + 1}: ")


@pytest.mark.parametrize(
  ("column", "value", "expected"),
  [
    ("answer", None, "field 'answer' is null"),
    ("answer", "\\boxed{}", "field 'answer'.*boxed"),
    ("answer", "#### N/A?", "math-verify cannot parse"),
    ("question", None, "field 'question' is null"),
  ],
)
def test_bad_parquet_rows_name_file_row_and_field(pool, tmp_path, column, value, expected):
  rng = np.random.default_rng(len(expected))
  rows = _word_rows(rng, int(rng.integers(3, 9)))
  row = int(rng.integers(0, len(rows)))
  rows[row][column] = value
  shard = tmp_path / "data" / "train-00001-of-00002.parquet"
  _parquet(tmp_path / "data" / "train-00000-of-00002.parquet", _word_rows(rng, 3, start=50))
  _parquet(shard, rows)
  with pytest.raises(DatasetError, match=expected) as e:
    _task(pool, tmp_path).records("train")
  assert str(e.value).startswith(f"{shard}: row {row}: ")


def test_parquet_without_a_column_or_with_a_wrong_type(pool, tmp_path):
  path = tmp_path / "x.parquet"
  _parquet(path, [{"question": "q", "solution": "#### 1"}])
  with pytest.raises(DatasetError, match=rf"^{path}: no column 'answer'.*answer_field"):
    _task(pool, path).records("train")
  _parquet(path, [{"question": 3, "answer": "#### 1"}])
  with pytest.raises(DatasetError, match=rf"^{path}: row 0: field 'question' must be a string"):
    _task(pool, path).records("train")
  (tmp_path / "empty").mkdir()
  with pytest.raises(DatasetError, match="no .jsonl, .parquet, .arrow files"):
    _task(pool, tmp_path / "empty").records("train")


def test_missing_path_is_one_config_error(tmp_path):
  missing = str(tmp_path / "nowhere" / "train.parquet")
  with pytest.raises(ValueError, match=f"config.task.path='{missing}' does not exist"):
    TaskConfig(name="math", path=missing)
  config = default_config()
  config.task.name = "math"
  config.task.path = missing
  with pytest.raises(ConfigError, match=f"config.task.path='{missing}' does not exist"):
    from_config_dict(config)


# -- rewards --------------------------------------------------------------------------------------


def test_rewards_of_word_problems(pool):
  rng = np.random.default_rng(6)
  task = _task(pool, SAMPLE)
  records, responses, expected = [], [], []
  for _ in range(20):
    value = int(rng.integers(1000, 10**7))
    record = {"answer": f"{value:,}"}
    delta = int(rng.integers(1, 9))
    cases = [
      (f"Adding up, the total is \\boxed{{{value}}}.", 1),
      (f"So there are {value:,} bolts.", 1),
      (f"$\\boxed{{{value:,}}}$", 1),
      (f"\\boxed{{{value + delta}}}", 0),
      (f"\\boxed{{{value}}} is wrong, it is \\boxed{{{value - delta}}}", 0),
      ("I do not know.", 0),
      ("", 0),
    ]
    for response, want in cases:
      records.append(record)
      responses.append(response)
      expected.append(want)
  batch = task.submit_rewards(records, responses).result()
  np.testing.assert_array_equal(batch.rewards_b, np.array(expected, np.float32))
  np.testing.assert_array_equal(batch.correct_b, np.array(expected, bool))
  assert batch.timeouts == 0 and batch.rewards_b.dtype == np.float32


def test_rewards_of_fractions_and_expressions(pool):
  rng = np.random.default_rng(7)
  task = _task(pool, SAMPLE)
  cases = []  # (gold, response, reward)
  for _ in range(12):
    p, q = int(rng.integers(1, 30)), int(rng.choice([2, 4, 5, 8, 10, 16, 20, 25]))
    k = int(rng.integers(2, 6))
    gold = f"\\frac{{{p}}}{{{q}}}"
    cases += [
      (gold, f"\\boxed{{\\frac{{{p * k}}}{{{q * k}}}}}", 1),
      (gold, f"The answer is $\\boxed{{{p / q}}}$", 1),
      (gold, f"\\boxed{{{p}/{q}}}", 1),
      (gold, f"\\boxed{{\\dfrac{{{p}}}{{{q}}}}}", 1),
      (gold, f"\\boxed{{\\frac{{{p + 1}}}{{{q}}}}}", 0),
    ]
    a = int(rng.integers(1, 9))
    square = f"x^2 + {2 * a}x + {a * a}"
    cases += [(square, f"\\boxed{{(x+{a})^2}}", 1), (square, f"\\boxed{{(x+{a + 1})^2}}", 0)]
  records = [{"answer": gold} for gold, _, _ in cases]
  rewards_b = task.rewards(records, [response for _, response, _ in cases])
  np.testing.assert_array_equal(rewards_b, np.array([want for _, _, want in cases], np.float32))
  assert task.reward({"answer": "\\frac{1}{2}"}, "0.5") == 1.0
  assert task.reward({"answer": "1,000"}, "1000") == 1.0


def test_only_the_answer_after_the_reasoning_is_scored(pool):
  task = _task(pool, SAMPLE, format_reward_weight=0.25)
  record = {"answer": "18"}
  responses = {
    "<think>Is it \\boxed{18}? Let me check again.</think>So it is \\boxed{20}.": 0.25,
    "<think>Is it \\boxed{20}? No.</think>So it is \\boxed{18}.": 1.0,
    "<think>It may be \\boxed{18}, but let me": 0.0,  # cut off while thinking: no answer
    "<think>Done.</think>The answer is 18.": 0.75,  # correct, not boxed
  }
  batch = task.submit_rewards([record] * len(responses), list(responses)).result()
  np.testing.assert_allclose(batch.rewards_b, list(responses.values()))
  assert verify.answer_part("no reasoning at all") == "no reasoning at all"


@pytest.mark.parametrize(
  ("value", "gold"),
  [(1e-05, "0.00001"), (9e16, "90000000000000000"), (0.5, "0.5"), (-2.0, "-2.0"), (7, "7")],
)
def test_numeric_gold_answers_are_written_in_positional_digits(pool, tmp_path, value, gold):
  # str(1e-05) is "1e-05", which math-verify reads as 1 * e - 5 (Euler's e): every correct
  # response would score 0.
  path = tmp_path / "numbers.jsonl"
  _write_jsonl(path, [{"question": "How much?", "answer": value}])
  task = _task(pool, path)
  (record,) = task.records("train") + task.records("test", num=None)
  assert record["answer"] == gold
  assert task.reward(record, f"\\boxed{{{gold}}}") == 1.0
  assert task.reward(record, "\\boxed{e-5}") == 0.0


def test_format_reward(pool):
  task = _task(pool, SAMPLE, format_reward_weight=0.25)
  record = {"answer": "72"}
  responses = {
    "so \\boxed{72}": 1.0,
    "so the answer is 72": 0.75,
    "so \\boxed{71}": 0.25,
    "so \\boxed{}": 0.0,
    "so \\boxed{7": 0.0,
    "no answer": 0.0,
  }
  batch = task.submit_rewards([record] * len(responses), list(responses)).result()
  np.testing.assert_allclose(batch.rewards_b, list(responses.values()))
  np.testing.assert_array_equal(batch.correct_b, [True, True, False, False, False, False])


@pytest.mark.parametrize(
  ("text", "expected"),
  [
    ("a \\boxed{1} b \\boxed{\\frac{1}{2}} c", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed {x^{2}}", "x^{2}"),
    ("\\fbox{3}", "3"),
    ("\\boxed{1} then \\boxed{2", None),
    ("\\boxed 5", None),
    ("no box", None),
  ],
)
def test_last_boxed(text, expected):
  assert verify.last_boxed(text) == expected
  assert verify.has_boxed_answer(text) == bool(expected)


def test_scoring_from_other_threads(pool):
  task = _task(pool, SAMPLE)
  rng = np.random.default_rng(8)
  values = rng.integers(0, 10**5, size=(4, 16))
  results = [None] * len(values)

  def score(i: int) -> None:
    records = [{"answer": str(v)} for v in values[i]]
    responses = [f"\\boxed{{{v + (j % 2)}}}" for j, v in enumerate(values[i])]
    results[i] = task.rewards(records, responses)

  threads = [threading.Thread(target=score, args=(i,)) for i in range(len(values))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for result in results:
    np.testing.assert_array_equal(result, np.tile([1.0, 0.0], 8))


def test_hung_and_crashed_checks_score_zero_are_counted_and_replaced(tmp_path):
  script = tmp_path / "faulty_worker.py"
  script.write_text(_FAULTY_WORKER.format(path=verify.__file__))
  pool = verify.VerifierPool(2, timeout_s=1.0, grace_s=1.0, worker_script=str(script))
  assert pool._thread is None  # nothing starts before the first request.
  task = tasks.Math(TaskConfig(name="math", path=SAMPLE), verifier=pool)
  try:
    assert task.rewards([{"answer": "1"}], ["\\boxed{1}"]).tolist() == [1.0]  # warm
    responses = ["\\boxed{1}", "HANG-SOFT", "HANG-HARD", "CRASH", "\\boxed{1}", "\\boxed{2}"]
    start = time.monotonic()
    batch = task.submit_rewards([{"answer": "1"}] * 6, responses).result(timeout=60)
    assert batch.rewards_b.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert batch.timeouts == 3
    assert pool.workers_replaced == 2  # the hard hang and the crash; the soft one was timed out
    assert time.monotonic() - start < 30
    again = task.submit_rewards([{"answer": "5"}] * 4, ["\\boxed{5}"] * 4).result(timeout=60)
    assert again.rewards_b.tolist() == [1.0] * 4 and again.timeouts == 0
    processes = [worker.proc for worker in pool._workers]
    assert len(processes) == 2
    stuck = task.submit_rewards([{"answer": "1"}], ["HANG-HARD"])
  finally:
    pool.close()
  assert all(p.poll() is not None for p in processes)  # close() stopped them.
  with pytest.raises(RuntimeError, match="closed"):
    stuck.result(timeout=10)  # in flight when the pool closed: failed, not left waiting.
  with pytest.raises(RuntimeError, match="closed"):
    pool.verify(["1"], ["1"])


def test_task_makes_its_pool_lazily_and_closes_it():
  task = tasks.make_task(TaskConfig(name="math", path=SAMPLE, reward_workers=1))
  assert isinstance(task, tasks.Math)
  task.close()  # nothing was started: nothing to stop.
  with tasks.make_task(TaskConfig(name="math", path=SAMPLE, reward_workers=1)) as task:
    pool = task.verifier
    assert pool.num_workers == 1 and pool.timeout_s == 5.0
  with pytest.raises(RuntimeError, match="closed"):
    pool.verify(["1"], ["1"])


def test_load_records_reports_every_bad_gold(tmp_path):
  path = tmp_path / "x.jsonl"
  _write_jsonl(path, [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)])

  def check(answers):
    return [None if a in ("0", "3") else "no" for a in answers]

  with pytest.raises(DatasetError, match=rf"^{path}:2: .*'1' \(no\) \(2 more rows"):
    math_data.load_records(
      str(path),
      check_answers=check,
      question_field="question",
      answer_field="answer",
      messages_field="",
      answer_format="auto",
      system_prompt="",
      instruction="",
    )


def test_pool_without_math_verify_says_what_to_install(monkeypatch):
  monkeypatch.setattr(verify.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ImportError, match=r"pip install 'jaxrl\[hf\]'"):
    verify.VerifierPool(1, timeout_s=1.0)
