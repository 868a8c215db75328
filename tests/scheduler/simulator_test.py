"""Simulator: conservation and staleness invariants, preemption, policy ordering, plots, CLI."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.model import get_preset
from jaxrl.scheduler import Workload, build_problem, cluster_from_dict, load_cluster
from jaxrl.scheduler.cost import decode_step_seconds, prefill_seconds
from jaxrl.scheduler.replan import PoolEvent
from jaxrl.scheduler.simulator import POLICIES, policy_plan, random_trace, simulate
from jaxrl.scheduler.timeline import KINDS, plot_comparison, plot_timeline

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {
  "name": "small",
  "pools": [
    {"name": "od", "accelerator": "H100", "nodes": 1, "devices_per_node": 8},
    {
      "name": "spot",
      "accelerator": "A100-80GB",
      "nodes": 2,
      "devices_per_node": 4,
      "inter_node_GBps": 25.0,
      "preemptible": True,
    },
  ],
}
STEPS = 6


def _problem(sigma=1.0, staleness=2, prompts=8, group=4, **kw):
  workload = Workload(
    prompts_per_step=prompts,
    group_size=group,
    prompt_len=128,
    response_median=256,
    response_sigma=sigma,
    response_cap=2048,
    max_staleness=staleness,
    **kw,
  )
  return build_problem(cluster_from_dict(SMALL), get_preset("qwen3-0.6b"), workload)


@pytest.fixture
def seed():
  return int(np.random.SeedSequence().entropy % 2**31)  # fresh each run; shown on failure


def _check(r, problem, steps=STEPS, msg=""):
  """Every sample trained once, none lost or duplicated, tokens and staleness accounted."""
  s = problem.workload.samples_per_step
  a = r.audit
  assert r.steps == steps and r.samples_trained == steps * s == a["trained"], msg
  assert a["trained_twice"] == a["duplicated"] == a["lost"] == 0, (msg, a)
  assert a["token_mismatch"] == a["forced_trains"] == a["stalled"] == 0, (msg, a)
  assert a["started"] == a["finished"] + a["running_at_end"] + a["queued_at_end"], (msg, a)
  assert sum(r.staleness_histogram.values()) == r.samples_trained, msg
  assert max(r.staleness_histogram) <= r.max_staleness, (msg, r.staleness_histogram)
  assert 0 < r.utilisation["rollout"] <= 1 and 0 < r.utilisation["train"] <= 1, msg
  assert r.wall_seconds > 0 and r.cost_dollars > 0 and r.samples_per_s > 0, msg
  assert {kind for *_, kind in r.timeline} <= set(KINDS), msg


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_each_sample_once_within_staleness(policy, seed):
  problem = _problem()
  r = simulate(problem, policy, STEPS, seed=seed)
  _check(r, problem, msg=f"seed {seed}")
  if policy in ("colocated_sync", "disagg_sync"):
    assert r.max_staleness == 0 and set(r.staleness_histogram) == {0}
    assert r.off_policy_token_fraction == 0
  else:
    assert r.max_staleness == 2 and r.off_policy_token_fraction > 0
  assert (r.adoption_reprefill_tokens > 0) == ("partial" in policy)


@pytest.mark.parametrize("notice_s", [0.0, 0.5])
def test_preemption_loses_nothing_and_resumes_with_the_prefix(notice_s, seed):
  problem = _problem(sigma=0.5, prompts=16, group=8)  # rollout capacity binds: spot helps
  _, plan = policy_plan(problem, "disagg_async_partial_spot")
  assert any(stage.pool == "spot" for stage in plan.rollout), plan.table()
  # Both events fall well inside the run: six steps take 5.3-7.6 simulated seconds over seeds.
  trace = [PoolEvent(2.5, "spot", 0, notice_s), PoolEvent(4.0, "spot", 2)]
  r = simulate(problem, "disagg_async_partial_spot", STEPS, seed=seed, trace=trace)
  _check(r, problem, msg=f"seed {seed}")
  assert r.preemptions >= 1 and r.replans == 2, r
  assert r.audit["handed_back"] > 0 and r.reprefilled_tokens > 0, (seed, r.audit)
  # Policies that hold no preemptible devices ignore the same trace.
  calm = simulate(problem, "disagg_async_partial", STEPS, seed=seed, trace=trace)
  assert calm.preemptions == calm.replans == 0


def test_random_trace_shape(seed):
  cluster = cluster_from_dict(SMALL)
  events = random_trace(cluster, "spot", 1000.0, 50.0, seed=seed)
  assert events, seed
  times = [e.time_s for e in events]
  assert times == sorted(times) and times[-1] < 1000
  nodes = 2
  for e in events:
    assert 0 <= e.nodes <= 2 and e.nodes != nodes and 0 <= e.notice_s <= e.time_s
    assert e.nodes < nodes or e.notice_s == 0  # grows come without notice
    nodes = e.nodes
  problem = _problem()
  r = simulate(problem, "disagg_async_partial_spot", STEPS, seed=seed, trace=events[:6])
  _check(r, problem, msg=f"seed {seed}")


def test_async_beats_sync_on_a_long_tail(seed):
  problem = _problem(sigma=1.5)
  sync = simulate(problem, "disagg_sync", STEPS, seed=seed)
  for policy in ("disagg_async", "disagg_async_partial"):
    r = simulate(problem, policy, STEPS, seed=seed)
    _check(r, problem, msg=f"seed {seed}")
    assert r.samples_per_s > 1.2 * sync.samples_per_s, (seed, policy)
  eta1 = simulate(_problem(sigma=1.5, staleness=1), "disagg_async", STEPS, seed=seed)
  assert max(eta1.staleness_histogram) <= 1


def test_colocated_is_slower_than_disaggregated_async(seed):
  problem = _problem(sigma=1.0)
  colocated = simulate(problem, "colocated_sync", STEPS, seed=seed)
  async_ = simulate(problem, "disagg_async", STEPS, seed=seed)
  assert async_.samples_per_s > 1.5 * colocated.samples_per_s, seed
  # Colocated devices alternate: the rollout lanes show the training phases.
  rollout_kinds = {kind for lane, *_, kind in colocated.timeline if lane != "train"}
  assert {"decode", "train"} <= rollout_kinds


def test_decode_time_matches_a_token_by_token_loop():
  """Equal lengths, one sync step: the rollout phase is prefill plus L decode steps per
  instance, which the event-driven simulator covers in a single segment each."""
  problem = _problem(sigma=0.0)
  w, model = problem.workload, problem.model
  sim_problem, plan = policy_plan(problem, "disagg_sync")
  r = simulate(problem, "disagg_sync", 1)
  left, expected = w.samples_per_step, 0.0
  for stage in plan.rollout:
    acc = sim_problem.cluster.accelerator(sim_problem.cluster.pool(stage.pool))
    t = stage.mesh["tensor"]
    for _ in range(stage.instances):
      n, left = min(stage.batch_size, left), left - min(stage.batch_size, left)
      if n:
        decode = sum(
          decode_step_seconds(model, acc, t, n, w.prompt_len + j)
          for j in range(int(w.response_median))
        )
        expected = max(expected, n * prefill_seconds(model, acc, t, w.prompt_len) + decode)
  start = min(s for lane, s, _, kind in r.timeline if lane == "train" and kind == "train")
  assert start == pytest.approx(expected, rel=1e-3)


def test_hundreds_of_instances_and_tens_of_thousands_of_requests():
  cluster = load_cluster(os.path.join(REPO, "configs", "clusters", "six_types.py"), "2048")
  workload = Workload(prompts_per_step=512, max_staleness=2)
  problem = build_problem(cluster, get_preset("qwen3-0.6b"), workload)
  _, plan = policy_plan(problem, "colocated_sync")
  assert sum(s.instances for s in plan.rollout) >= 200
  r = simulate(problem, "colocated_sync", 10)
  _check(r, problem, steps=10)
  assert r.audit["started"] >= 40_000
  assert r.events < 3 * r.audit["started"]  # events per request, not per token
  assert len({lane for lane, *_ in r.timeline}) <= 64


def test_plots_are_written(tmp_path):
  problem = _problem()
  results = [simulate(problem, p, 3) for p in ("colocated_sync", "disagg_async_partial")]
  paths = [plot_comparison(results, str(tmp_path / "comparison.png"))]
  paths += [plot_timeline(r, str(tmp_path / f"timeline_{r.policy}.png")) for r in results]
  for path in paths:
    assert os.path.getsize(path) > 1000


def test_bad_policy_and_trace_say_what_is_wrong():
  problem = _problem()
  with pytest.raises(ValueError, match="unknown policy 'fastest'.*disagg_async_partial_spot"):
    simulate(problem, "fastest", 1)
  with pytest.raises(ValueError, match="pool must be one of"):
    simulate(problem, "disagg_async_partial_spot", 1, trace=[PoolEvent(1.0, "gpu", 0)])
  cmd = [sys.executable, os.path.join(REPO, "launch", "simulate.py"), "--policies", "fastest"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
  assert out.returncode != 0 and "unknown policy ['fastest']" in out.stderr
  assert "Traceback" not in out.stderr


def test_cli_end_to_end(tmp_path):
  cmd = [
    sys.executable,
    os.path.join(REPO, "launch", "simulate.py"),
    "--cluster=configs/clusters/ondemand_preemptible.py",
    "--model=qwen3-0.6b",
    "--policies=disagg_sync,disagg_async_partial_spot",
    "--steps=3",
    "--prompts_per_step=4",
    "--group_size=4",
    "--prompt_len=64",
    "--response_median=128",
    "--response_cap=1024",
    "--trace=random",
    f"--out={tmp_path}",
  ]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "disagg_sync" in out.stdout and "disagg_async_partial_spot" in out.stdout
  names = ["comparison.png", "timeline_disagg_sync.png", "timeline_disagg_async_partial_spot.png"]
  for name in names:
    assert os.path.getsize(tmp_path / name) > 1000
  summary = json.loads((tmp_path / "results.json").read_text())
  assert [r["samples_trained"] for r in summary["results"]] == [48, 48]
  assert all(r["audit"]["lost"] == 0 for r in summary["results"])
