"""`VerifierPool.check_answers`' plain-number path: the forms it lets through parse, they need
no worker, and a mixed list keeps each answer's verdict in its place."""

import pytest

pytest.importorskip("math_verify")

from jaxrl.data import verify  # noqa: E402

PLAIN = ("0", "7", "-3", "+3", "007", "0.5", "-0.25", "3.14159", "1000000", "-0", "+0.0")
PLAIN += ("123456789012345678901234567890",)


@pytest.mark.parametrize("answer", PLAIN)
def test_plain_numbers_are_what_math_verify_parses(answer):
  assert verify.PLAIN_NUMBER.fullmatch(answer)
  (value,) = verify.parse_gold(answer)[:1]
  assert float(value) == float(answer)


@pytest.mark.parametrize("answer", ["1,000", "3/4", " 7", "7 ", "1e5", ".5", "5.", "x", ""])
def test_other_answers_go_to_the_workers(answer):
  assert not verify.PLAIN_NUMBER.fullmatch(answer)


def test_plain_number_answers_pass_without_a_worker(tmp_path):
  """Workers that die at start: any answer sent to one would fail its check."""
  dead = tmp_path / "dead_worker.py"
  dead.write_text("import sys\nsys.exit(3)\n")
  pool = verify.VerifierPool(2, 5.0, worker_script=str(dead))
  try:
    checked = pool.check_answers(list(PLAIN))
    assert checked.done() and checked.result() == [None] * len(PLAIN)
  finally:
    pool.close()


def test_a_mixed_list_keeps_each_verdict_in_its_place():
  answers = ["72", "\\frac{1}{2}", "N/A?", "-4", "x^2+1", "1,000"]
  with verify.VerifierPool(2, 10.0) as pool:
    reasons = pool.check_answers(answers).result(timeout=120)
  assert [r is None for r in reasons] == [True, True, False, True, True, True]
  assert "no expression" in reasons[2]
