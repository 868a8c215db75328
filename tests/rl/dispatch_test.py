"""Skew-aware dispatch: the length predictor, release order and the spread over workers."""

import collections
import time

import numpy as np
import pytest

from jaxrl.data.tasks import make_task
from jaxrl.rl import job
from jaxrl.rl.dispatch import LengthPredictor, WorkerRates
from jaxrl.rl.groups import parse_request_id

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


def test_worker_rates_start_from_the_prediction_and_switch_to_the_measurement():
  rng = np.random.default_rng()
  fast, slow = rng.uniform(100, 200), rng.uniform(10, 50)
  r = WorkerRates(min_work=100, decay=0.5)
  r.add("a", fast)
  r.add("b", slow)
  r.add("c", None)  # unknown: the default, 1 token/s
  assert r.rate("a") == fast and r.rate("b") == slow and r.rate("c") == 1.0
  shares = r.shares()
  assert sum(shares.values()) == pytest.approx(1.0)
  assert shares["a"] / shares["b"] == pytest.approx(fast / slow)
  r.observe("a", 50, 1.0)  # less work than min_work: still the prediction
  assert r.rate("a") == fast
  r.observe("a", 250, 1.0)  # 300 units in 2 s, the first half weighing half: measured
  measured = (0.5 * 50 + 250) / (0.5 * 1.0 + 1.0)
  assert r.rate("a") == pytest.approx(measured)
  # b is not measured yet: its prediction is scaled by a's measured / predicted.
  assert r.rate("b") == pytest.approx(slow * measured / fast)
  for _ in range(30):  # a stall is forgotten: the rate follows the recent events
    r.observe("a", 100, 0.5)
  assert r.rate("a") == pytest.approx(200.0, rel=1e-6)
  r.remove("a")
  assert r.rate("b") == slow and set(r.shares()) == {"b", "c"}
  with pytest.raises(ValueError, match="positive"):
    r.add("d", -1.0)
  with pytest.raises(ValueError, match="decay"):
    WorkerRates(decay=0.0)


def test_requests_split_by_worker_rate(tmp_path):
  """A worker predicted three times as fast gets about three times the predicted tokens."""
  cfg = async_config(**{"loop.max_staleness": 2, "train.steps": 1})
  c = job.build_controller(cfg, str(tmp_path), show_progress=False)
  rng = np.random.default_rng()
  for record in make_task(cfg.task).records("train", None, cfg.seed):
    c.lengths.update(record["id"], [float(rng.lognormal(3.0, 1.0))])
  c._release()
  predicted = [c._predicted_left(rid) for rid in c.pending]
  workers = [FakeWorker("fast", capacity=1000), FakeWorker("slow", capacity=1000)]
  c.workers = {w.name: w for w in workers}
  c.rates.add("fast", 300.0)
  c.rates.add("slow", 100.0)
  c._dispatch()
  fast, slow = (sum(c._predicted_left(a.record.request_id) for a in w.got) for w in workers)
  # Greedy by finishing time: the two finish within one request's time of each other.
  assert abs(fast / 300.0 - slow / 100.0) <= max(predicted) / 100.0
  assert fast > 2 * slow


def test_a_slow_worker_is_measured_and_given_less_work(tmp_path):
  cfg = async_config(**{"loop.max_staleness": 1, "train.steps": 4, "loop.measured_rates": True})
  c = job.build_controller(cfg, str(tmp_path), show_progress=False)
  c.rates.min_work = 4
  slow = c.initial_workers[1]
  step = slow.engine.step

  def slow_step():
    time.sleep(0.15)
    return step()

  slow.engine.step = slow_step
  sent = collections.Counter()
  for w in c.initial_workers:
    submit = w.submit
    w.submit = lambda assignments, _submit=submit, _name=w.name: (
      sent.update({_name: len(assignments)}),
      _submit(assignments),
    )
  seen = {}
  c.on_train.append(lambda step, groups: seen.update({n: c.rates.rate(n) for n in c.workers}))
  c.run()
  assert seen[slow.name] < min(v for n, v in seen.items() if n != slow.name)
  assert sent[slow.name] < min(v for n, v in sent.items() if n != slow.name)
  assert c.counters["split_replans"] >= 2  # once per worker added
