"""The staleness rule the async loop and the simulator share: admission and batch choice."""

import pytest

from jaxrl.scheduler.staleness import BatchChoice, admission_cap, choose_batch


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_admission_lets_eta_plus_one_steps_of_groups_start(eta):
  assert admission_cap(0, eta, 4) == 4 * (eta + 1)
  assert admission_cap(5, eta, 4) - admission_cap(4, eta, 4) == 4


def test_oldest_versions_train_first_then_completion_order():
  ready = [("c", 2), ("a", 1), ("d", 2), ("b", 1), ("e", 3)]
  assert choose_batch(ready, [], 2, 2, 3) == BatchChoice(["a", "b", "c"])
  assert choose_batch(ready[:2], [], 2, 2, 3) is None  # fewer than a step's groups


def test_the_learner_waits_for_a_group_that_would_fall_out_of_the_bound():
  # Version 3, eta 1: a group of version u trains at version u + 1 at the latest.
  # Training the two version-2 groups leaves a version-2 group in flight, due now: wait.
  assert choose_batch([("x", 2), ("y", 2)], [2], 3, 1, 2) is None
  # A version-3 group in flight is due by the next step, which has room for it: train.
  assert choose_batch([("x", 2), ("y", 2)], [3], 3, 1, 2) == BatchChoice(["x", "y"])
  # Three version-3 groups left for the next step of two: wait while one is in flight.
  assert choose_batch([("x", 3), ("y", 3), ("z", 2), ("w", 2)], [3], 3, 1, 2) is None


def test_a_bound_that_waiting_cannot_keep_forces_the_step():
  """With nothing in flight, waiting never ends: the step trains and says it was forced."""
  ready = [("x", 3), ("y", 3), ("z", 1), ("w", 1), ("v", 1)]
  assert choose_batch(ready, [], 3, 1, 2) == BatchChoice(["z", "w"], forced=True)


def test_synchronous_bound_trains_only_the_current_version():
  assert choose_batch([("a", 0), ("b", 0)], [], 0, 0, 2) == BatchChoice(["a", "b"])
  assert choose_batch([("a", 0), ("b", 0)], [0], 0, 0, 2) is None
