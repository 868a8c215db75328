"""The staleness bound of asynchronous RL as pure functions: which groups may start, which train.

The RL loop (`jaxrl.rl.controller`) and the simulator (`jaxrl.scheduler.simulator`) both
call these, so that the simulator's policy comparisons run the rule the loop runs.

A group (one prompt's G responses) started at learner version u holds tokens of version >= u;
it must be trained by the step that makes version u + eta, eta = `max_staleness`, so that no
trained token is more than eta versions older than the weights it is trained on. eta = 0 is the
synchronous loop. Admission control starts group k only once k < (version + eta + 1) x n
(n = prompts per step); each step trains n finished groups, oldest version first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence


def admission_cap(version: int, max_staleness: int, prompts_per_step: int) -> int:
  """Groups that may have started at learner `version`: group k starts only if k < this."""
  return (version + max_staleness + 1) * prompts_per_step


@dataclasses.dataclass(frozen=True)
class BatchChoice:
  """The groups of the next step (ids, oldest version first, then completion order), and
  whether the bound forced it: a group left over is due before later steps can train it, and
  nothing is in flight whose completion could change that (waiting would never end)."""

  groups: list[Hashable]
  forced: bool = False


def choose_batch(
  ready: Sequence[tuple[Hashable, int]],
  in_flight_versions: Iterable[int],
  version: int,
  max_staleness: int,
  prompts_per_step: int,
) -> BatchChoice | None:
  """The next step's groups, or None while the learner must wait.

  Args:
    ready: (group id, start version) of the finished, untrained groups, in completion order.
    in_flight_versions: the start version of every group started and not finished.
    version: the learner's version (the step about to train makes version + 1).
    max_staleness: the bound eta.
    prompts_per_step: groups per step, n.

  It takes the n ready groups of the oldest versions. A group of version u must be trained by
  the step that makes u + eta: after this step, m more steps of n groups each can take only the
  groups due by version + m, so the learner waits while more than m x n of the groups it leaves
  are due by then and some group is still in flight.
  """
  n = prompts_per_step
  if len(ready) < n:
    return None
  order = sorted(range(len(ready)), key=lambda i: (ready[i][1], i))
  chosen = set(order[:n])
  in_flight = list(in_flight_versions)
  left = [ready[i][1] for i in range(len(ready)) if i not in chosen] + in_flight
  for m in range(max_staleness + 1):
    due = sum(1 for u in left if u <= version + m - max_staleness)
    if due > m * n:
      if in_flight:
        return None  # wait for the old groups to finish
      return BatchChoice([ready[i][0] for i in order[:n]], forced=True)
  return BatchChoice([ready[i][0] for i in order[:n]])
