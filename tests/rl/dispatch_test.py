"""Skew-aware dispatch: the length predictor, release order and the spread over workers."""

import numpy as np
import pytest

from jaxrl.data.tasks import make_task
from jaxrl.rl import job
from jaxrl.rl.async_controller import parse_request_id
from jaxrl.rl.dispatch import LengthPredictor

from .async_test import async_config  # noqa: TID252


def test_length_predictor_learns_per_prompt_and_falls_back_to_the_mean():
  p = LengthPredictor(decay=0.5, default=7.0)
  assert p.predict("a") == 7.0
  p.update("a", [10, 20])
  assert p.predict("a") == 15.0
  assert p.predict("b") == 15.0  # unseen: mean over every response so far
  p.update("a", [5, 5])
  assert p.predict("a") == pytest.approx(0.5 * 15 + 0.5 * 5)
  q = LengthPredictor()
  q.load(p.state())
  assert q.predict("a") == p.predict("a") and q.predict("zzz") == p.predict("zzz")
  with pytest.raises(ValueError, match="decay"):
    LengthPredictor(decay=1.0)


class FakeWorker:
  def __init__(self, name, capacity):
    self.name, self.capacity, self.alive, self.got = name, capacity, True, []

  def submit(self, assignments):
    self.got += assignments


@pytest.mark.parametrize("skew_aware", [True, False])
def test_longest_predicted_requests_start_first_and_spread_by_tokens(tmp_path, skew_aware):
  cfg = async_config(
    **{"loop.max_staleness": 2, "loop.skew_aware_dispatch": skew_aware, "train.steps": 1}
  )
  c = job.build_controller(cfg, str(tmp_path), show_progress=False)
  rng = np.random.default_rng()
  for record in make_task(cfg.task).records("train", None, cfg.seed):
    c.lengths.update(record["id"], [float(rng.lognormal(3.0, 1.0))])
  c._release()
  predicted = [c._predicted_left(rid) for rid in c.pending]
  groups = [parse_request_id(rid)[0] for rid in c.pending]
  if skew_aware:
    assert predicted == sorted(predicted, reverse=True)
  else:
    assert groups == sorted(groups)  # release order
  workers = [FakeWorker(f"f{i}", capacity=1000) for i in range(3)]
  c.workers = {w.name: w for w in workers}
  c._dispatch()
  assert not c.pending
  tokens = [sum(c._predicted_left(a.record.request_id) for a in w.got) for w in workers]
  counts = [len(w.got) for w in workers]
  if skew_aware:  # greedy longest-first: loads differ by at most one request's prediction
    assert max(tokens) - min(tokens) <= max(predicted)
  else:
    assert max(counts) - min(counts) <= 1
