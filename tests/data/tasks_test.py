"""Tests of the synthetic tasks: records, rewards and the train/test split."""

import json
import operator
import types

import numpy as np
import pytest

from jaxrl.data import tasks
from jaxrl.data.countdown import evaluate_countdown
from jaxrl.data.task_base import split_of
from jaxrl.data.tasks import TaskConfig, make_task

SYNTHETIC = {
  "arithmetic": TaskConfig(name="arithmetic", num_digits=2, operations="+-*"),
  "digit_sort": TaskConfig(name="digit_sort", sort_length=6),
  "countdown": TaskConfig(name="countdown", countdown_numbers=4),
}
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.mark.parametrize(
  ("kwargs", "field"),
  [
    ({"num_digits": 0}, "num_digits"),
    ({"operations": "+/"}, "operations"),
    ({"operations": ""}, "operations"),
    ({"operations": "++"}, "operations"),
    ({"sort_length": 0}, "sort_length"),
    ({"sort_length": 5, "sort_length_max": 3}, "sort_length_max"),
    ({"sort_length_max": 19}, "sort_length_max"),
    ({"countdown_numbers": 1}, "countdown_numbers"),
    ({"eval_size": 0}, "eval_size"),
    ({"reward": "fuzzy"}, "reward"),
    ({"reward": "partial"}, "reward"),  # arithmetic has no partial credit.
    ({"name": "gsm8k"}, "path"),
    ({"name": "math"}, "path"),
    ({"name": "gsm8k", "path": "/nonexistent/gsm.jsonl"}, "path='/nonexistent/gsm.jsonl' does"),
    ({"answer_format": "latex"}, "answer_format"),
    ({"format_reward_weight": 1.5}, "format_reward_weight"),
    ({"format_reward_weight": -0.1}, "format_reward_weight"),
    ({"verify_timeout_s": 0.0}, "verify_timeout_s"),
    ({"reward_workers": 0}, "reward_workers"),
    ({"question_field": ""}, "question_field"),
    ({"answer_field": ""}, "answer_field"),
  ],
)
def test_config_validation_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"^config.task.{field}"):
    TaskConfig(**kwargs)


def test_path_kinds_are_checked(tmp_path):
  with pytest.raises(ValueError, match=f"config.task.path='{tmp_path}' is a directory"):
    TaskConfig(name="gsm8k", path=str(tmp_path))
  assert TaskConfig(name="math", path=str(tmp_path)).path == str(tmp_path)
  assert TaskConfig(name="digit_sort", path="/nonexistent").path == "/nonexistent"  # unused


@pytest.mark.parametrize("name", ["train-00000-of-00001.parquet", "data-00000-of-00001.arrow"])
def test_gsm8k_given_parquet_or_arrow_says_the_math_task_reads_it(tmp_path, name):
  path = tmp_path / name
  path.write_bytes(b"PAR1\x15\x04\x90")  # GSM8K's Hub form; never read as text
  with pytest.raises(ValueError, match=r"is a \.(parquet|arrow) file; .*task.name='math'"):
    TaskConfig(name="gsm8k", path=str(path))
  assert TaskConfig(name="math", path=str(path)).path == str(path)


def test_synthetic_tasks_score_batches():
  task = make_task(SYNTHETIC["arithmetic"])
  records = task.records("test", 20)
  right = np.random.default_rng(7).random(20) < 0.5
  responses = [r["answer"] + ("" if ok else "1") for r, ok in zip(records, right, strict=True)]
  batch = task.submit_rewards(records, responses).result()
  expected = right.astype(np.float32)
  np.testing.assert_array_equal(batch.rewards_b, expected)
  np.testing.assert_array_equal(batch.correct_b, np.array(expected, bool))
  assert batch.timeouts == 0 and batch.rewards_b.dtype == np.float32
  np.testing.assert_array_equal(task.rewards(records, responses), expected)
  with pytest.raises(ValueError, match="20 records but 19 responses"):
    task.rewards(records, responses[:-1])


def test_unknown_task_lists_known_names():
  with pytest.raises(ValueError) as e:
    TaskConfig(name="chess")
  for name in tasks.TASKS:
    assert name in str(e.value)
  with pytest.raises(ValueError, match="digit_sort"):
    make_task(types.SimpleNamespace(name="chess"))


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_train_and_test_are_disjoint(name):
  task = make_task(SYNTHETIC[name])
  test = task.records("test", 100)
  test_keys = {task.problem_key(r) for r in test}
  assert len(test_keys) == len(test)
  assert all(split_of(k) == "test" for k in test_keys)
  for seed in (0, 1):
    train = task.records("train", 1000, seed=seed)
    train_keys = {task.problem_key(r) for r in train}
    assert len(train_keys) == len(train) == 1000
    assert not train_keys & test_keys
    assert all(split_of(k) == "train" for k in train_keys)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_test_split_is_fixed(name):
  first = make_task(SYNTHETIC[name]).records("test", 60, seed=0)
  again = make_task(SYNTHETIC[name]).records("test", 60, seed=12345)
  assert first == again
  assert make_task(SYNTHETIC[name]).records("test", 20, seed=3) == first[:20]
  assert len({r["id"] for r in first}) == len(first)
  json.dumps(first)  # records are plain JSON data.


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_train_split_depends_on_seed_only(name):
  task = make_task(SYNTHETIC[name])
  a, b = task.records("train", 200, seed=5), make_task(SYNTHETIC[name]).records("train", 200, 5)
  assert a == b
  assert a != task.records("train", 200, seed=6)


def test_split_is_about_one_tenth():
  task = make_task(TaskConfig(name="digit_sort", sort_length=4))
  train, test = task.records("train"), task.records("test", 900)
  assert len(train) + len(test) <= 10_000
  assert 900 <= 10_000 - len(train) <= 1100
  assert len(task.records("test", 2000)) < 2000  # all there are (warned)
  with pytest.raises(ValueError, match="only"):
    task.records("train", 20_000)
  with pytest.raises(ValueError, match="split"):
    task.records("validation", 10)


def test_test_split_defaults_to_eval_size():
  task = make_task(TaskConfig(name="digit_sort", eval_size=37))
  assert len(task.records("test")) == 37


def test_arithmetic_records_and_reward():
  task = make_task(TaskConfig(num_digits=2, operations="-*"))
  rng = np.random.default_rng(0)
  records = task.records("train", 300, seed=int(rng.integers(1000)))
  seen_ops = set()
  for r in records:
    a, op, b = tasks._split_binary(r["prompt"].removesuffix("="))
    seen_ops.add(op)
    assert r["prompt"].endswith("=") and 0 <= a < 100 and 0 <= b < 100
    assert int(r["answer"]) == _OPS[op](a, b)
    assert task.reward(r, r["answer"]) == 1.0
    assert task.reward(r, f"  {r['answer']}\n") == 1.0
    wrong = int(r["answer"]) + int(rng.choice([-1, 1])) * int(rng.integers(1, 50))
    assert task.reward(r, str(wrong)) == 0.0
    for malformed in ["", " ", "x", r["answer"] + "=", r["answer"] + ".5", "1 2", "--3"]:
      assert task.reward(r, malformed) == 0.0
  assert seen_ops == {"-", "*"}


def test_arithmetic_commutative_problems_are_one_problem():
  task = make_task(TaskConfig(num_digits=1, operations="+"))
  records = task.records("train") + task.records("test")
  keys = [task.problem_key(r) for r in records]
  assert len(keys) == len(set(keys)) == 55  # unordered pairs of digits
  assert task.problem_key({"prompt": "7+3="}) == task.problem_key({"prompt": "3+7="})


@pytest.mark.parametrize("reward", ["exact", "partial"])
def test_digit_sort_reward(reward):
  task = make_task(TaskConfig(name="digit_sort", sort_length=7, reward=reward))
  rng = np.random.default_rng(1)
  for r in task.records("test", 50):
    digits = r["prompt"].removeprefix("sort:").removesuffix("=")
    assert r["answer"] == "".join(sorted(digits)) and len(digits) == 7
    assert task.reward(r, r["answer"]) == 1.0
    assert task.reward(r, f"\t{r['answer']} ") == 1.0
    wrong = list(r["answer"])
    flips = rng.choice(7, size=int(rng.integers(1, 4)), replace=False)
    for i in flips:
      wrong[i] = "x"
    expected = (7 - len(flips)) / 7 if reward == "partial" else 0.0
    assert task.reward(r, "".join(wrong)) == pytest.approx(expected)
    assert task.reward(r, r["answer"][:-1]) == 0.0
    assert task.reward(r, r["answer"] + "1") == 0.0
    assert task.reward(r, "") == 0.0


def test_countdown_instances_are_solvable():
  task = make_task(TaskConfig(name="countdown", countdown_numbers=5))
  for r in task.records("train", 300, seed=3) + task.records("test", 50):
    assert len(r["numbers"]) == 5 and all(1 <= n <= 25 for n in r["numbers"])
    assert 1 <= r["target"] <= 999
    assert r["prompt"] == f"countdown:{','.join(map(str, r['numbers']))} target:{r['target']}="
    assert evaluate_countdown(r["answer"], r["numbers"]) == r["target"]
    assert task.reward(r, r["answer"]) == 1.0
    assert task.reward(r, f"  {r['answer']}  ") == 1.0


def test_countdown_reward_wrong_and_malformed():
  task = make_task(TaskConfig(name="countdown", countdown_numbers=3))
  for r in task.records("test", 50):
    a, b, c = r["numbers"]
    others = {f"{a}+{b}+{c}", f"{a}*{b}", f"{c}", f"({a}-{b})*{c}"}
    for response in others:
      expected = float(evaluate_countdown(response, r["numbers"]) == r["target"])
      assert task.reward(r, response) == expected
    unused = next(n for n in range(26, 100) if n not in r["numbers"])
    for malformed in [
      "",
      f"{a}+",
      f"({a}+{b}",
      f"{a}/{b}",
      f"-{a}+{b}",
      f"{a}**{b}",
      f"{a}+{a}+{a}+{a}",  # more copies than given
      f"{unused}",
      "__import__('os')",
      r["answer"] + "=" + str(r["target"]),
    ]:
      assert task.reward(r, malformed) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_evaluate_countdown_matches_python_on_random_expressions(seed):
  rng = np.random.default_rng(seed)
  for _ in range(200):
    numbers = rng.integers(1, 30, int(rng.integers(1, 6))).tolist()
    terms = [str(n) for n in numbers]
    while len(terms) > 1:
      a, b = terms.pop(int(rng.integers(len(terms)))), terms.pop(int(rng.integers(len(terms))))
      op = "+-*"[int(rng.integers(3))]
      terms.append(f"({a} {op} {b})" if rng.random() < 0.7 else f"{a}{op}{b}")
    expression = terms[0]
    # The test generated this string itself from digits and operators, so eval is safe here.
    assert evaluate_countdown(expression, numbers) == eval(expression)  # noqa: S307


@pytest.mark.parametrize(
  ("expression", "reason"),
  [
    ("3/4", "'/'"),
    ("3 ^ 4", "'\\^'"),
    ("3+", "expected a number"),
    ("(3+4))", "unexpected"),
    ("((3+4)", "parentheses"),
    ("3 4", "unexpected"),
    ("3+3", "used too often"),
    ("5", "not among"),
    ("(" * 40 + "3" + ")" * 40, "deeper"),
    ("3+" * 200 + "3", "longer"),
  ],
)
def test_evaluate_countdown_rejects(expression, reason):
  with pytest.raises(ValueError, match=reason):
    evaluate_countdown(expression, [3, 4])


def test_digit_sort_long_tail_lengths():
  task = make_task(TaskConfig(name="digit_sort", sort_length=4, sort_length_max=18))
  records = task.records("train", 1000, seed=0)
  lengths = np.array([len(r["answer"]) for r in records])
  assert 3 <= np.median(lengths) <= 5 and lengths.max() >= 14 and lengths.min() >= 1
  for r in records[:50]:
    digits = r["prompt"][len("sort:") : -1]
    assert r["answer"] == "".join(sorted(digits))
    assert task.reward(r, r["answer"]) == 1.0


def test_more_eval_prompts_than_a_generated_task_has_evaluates_on_all(caplog):
  task = make_task(TaskConfig(name="countdown", countdown_numbers=2))
  records = task.records("test", 128)
  assert 0 < len(records) < 128
  assert "config.eval.num_prompts=128 asks for more test problems than task" in caplog.text
