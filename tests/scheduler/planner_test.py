"""Planner: optimality against exhaustive search, monotonicity, memory, errors, cluster files."""

import dataclasses
import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.model import get_preset
from jaxrl.scheduler import (
  CATALOG,
  PlannerConfig,
  PlanningError,
  Workload,
  build_problem,
  cluster_from_dict,
  fit_decode_efficiency,
  load_cluster,
  plan,
)
from jaxrl.scheduler import cost as cost_model
from jaxrl.scheduler.cost import USABLE_MEMORY, decode_roofline_seconds, rollout_cost, train_cost
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.planner import exhaustive_best, plan_colocated

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = sorted(glob.glob(os.path.join(REPO, "configs", "clusters", "*.py")))
SMALL_TYPES = ("H100", "A100-80GB", "L40S", "L4", "RTX4090", "v5e")


def _small_problem(rng):
  """2-3 pools, at most 12 devices, a few rollout options per pool (exhaustive stays cheap)."""
  types = rng.choice(SMALL_TYPES, size=int(rng.integers(2, 4)), replace=False)
  pools, left = [], 12
  for i, t in enumerate(types):
    per_node = int(rng.choice([2, 4]))
    nodes = int(rng.integers(1, 3)) if left >= 2 * per_node else 1
    nodes = min(nodes, left // per_node)
    if nodes == 0:
      continue
    left -= nodes * per_node
    pools.append(
      {
        "name": f"p{i}",
        "accelerator": str(t),
        "nodes": nodes,
        "devices_per_node": per_node,
        "inter_node_GBps": float(rng.choice([6.25, 25.0])),
        "preemptible": bool(i > 0 and rng.random() < 0.3),
      }
    )
  cluster = cluster_from_dict({"name": "small", "pools": pools})
  workload = Workload(
    prompts_per_step=int(rng.integers(4, 17)),
    group_size=int(rng.choice([4, 8])),
    prompt_len=int(rng.integers(64, 512)),
    response_median=float(rng.integers(128, 1024)),
    response_sigma=float(rng.uniform(0.2, 1.2)),
    response_cap=4096,
    max_staleness=int(rng.choice([0, 1, 3])),
  )
  problem = build_problem(cluster, get_preset("qwen3-0.6b"), workload)
  # Keep up to 3 rollout options per pool, at least one of which can host the tail.
  keep = []
  for name in sorted({o.pool for o in problem.rollout}):  # sorted: a seed gives one problem
    idx = [i for i, o in enumerate(problem.rollout) if o.pool == name]
    chosen = list(rng.choice(idx, size=min(3, len(idx)), replace=False))
    hosts = [i for i in idx if problem.tail_host_ok(i)]
    if hosts and not any(problem.tail_host_ok(i) for i in chosen):
      chosen[0] = hosts[0]
    keep += sorted(int(i) for i in chosen)
  return dataclasses.replace(problem, rollout=tuple(problem.rollout[i] for i in sorted(keep)))


@pytest.mark.parametrize("case", range(6))
def test_planner_reaches_99_percent_of_exhaustive_search(case):
  # A fresh instance each run, its seed in any failure: HiGHS once stopped with "Solve error"
  # (status 4, with and without presolve) on an instance 3,000 seeded ones did not reproduce.
  _check_against_exhaustive_search(int(np.random.SeedSequence().entropy % (1 << 32)))


# Seeds of the test above on which HiGHS (scipy 1.17.1) reported "optimal" for a plan up to
# 34% short of the best: the first five with its presolve, the next four without (of 5,000
# seeds each way). The planner solves each model both ways and keeps the better
# (`PlanMilp._milp`). On the last, both ways stopped with "Solve error" (status 4) within
# a budget; the model then solves with its continuous variables in other units.
@pytest.mark.parametrize("seed", [944, 1419, 2876, 2892, 4048, 54, 776, 2615, 2855, 6610])
def test_planner_reaches_exhaustive_search_where_the_solver_fell_short(seed):
  _check_against_exhaustive_search(seed)


def _check_against_exhaustive_search(seed: int) -> None:
  rng = np.random.default_rng(seed)
  try:
    problem = _small_problem(rng)
  except PlanningError:
    pytest.skip("random cluster holds no feasible plan")  # rare: retried by other cases
  try:
    full = plan(problem).cost_per_hour
  except PlanningError as e:
    raise AssertionError(f"seed {seed}: {e}") from e
  for budget in (math.inf, 0.6 * full):
    try:
      best = exhaustive_best(problem, budget)
    except PlanningError:
      with pytest.raises(PlanningError):
        plan(problem, PlannerConfig(budget_per_hour=budget))
      continue
    got = plan(problem, PlannerConfig(budget_per_hour=budget))
    assert got.cost_per_hour <= budget + 1e-6, f"seed {seed}"
    assert got.throughput_samples_per_s >= 0.99 * best.throughput_samples_per_s, (
      f"seed {seed}, budget {budget}",
      problem.workload,
      got.table(),
      best.table(),
    )


def _six(devices):
  return load_cluster(os.path.join(REPO, "configs", "clusters", "six_types.py"), str(devices))


@pytest.mark.parametrize("staleness", [0, 2])
def test_more_devices_or_budget_never_lower_throughput(staleness):
  model = get_preset("qwen3-8b")
  workload = Workload(max_staleness=staleness, prompts_per_step=32)
  base = load_cluster(os.path.join(REPO, "configs", "clusters", "ondemand_preemptible.py"), "2")
  last = 0.0
  for spot_nodes in (0, 1, 2, 4, 8):
    cluster = base.with_pool_nodes("a100-spot", spot_nodes)
    got = plan(build_problem(cluster, model, workload)).throughput_samples_per_s
    assert got >= last * (1 - 1e-6)
    last = got
  problem = build_problem(base, model, workload)
  last = 0.0
  for budget in (80, 120, 160, 240, 400, math.inf):
    got = plan(problem, PlannerConfig(budget_per_hour=budget))
    assert got.cost_per_hour <= budget + 1e-6
    assert got.throughput_samples_per_s >= last * (1 - 1e-6)
    last = got.throughput_samples_per_s


@pytest.mark.parametrize("path", CLUSTERS, ids=os.path.basename)
def test_every_cluster_file_plans_within_memory(path):
  cluster = load_cluster(path, "static" if path.endswith("local_cpu.py") else None)
  # Specs of this machine (and the Ray test rig's fake nodes) are planned for the tiny model.
  local = path.endswith(("local_cpu.py", "ray_rig.py"))
  model = get_preset("tiny" if local else "qwen3-8b")
  workload = Workload(prompt_len=16, response_median=8, response_cap=16) if local else Workload()
  problem = build_problem(cluster, model, workload)
  for p in (plan(problem), plan_colocated(problem)):
    used = dict(p.train.pools)
    for r in p.rollout:
      if p.mode != "colocated":  # colocated stages share their devices
        used[r.pool] = used.get(r.pool, 0) + r.devices
      acc = cluster.accelerators[r.accelerator]
      assert r.memory_per_device_gib * 2**30 <= USABLE_MEMORY * acc.memory_bytes
    acc = cluster.accelerators[p.train.accelerator]
    assert p.train.memory_per_device_gib * 2**30 <= USABLE_MEMORY * acc.memory_bytes
    assert used == p.devices_used
    for name, n in used.items():
      assert n <= cluster.pool(name).devices
    assert p.throughput_samples_per_s > 0 and p.bottleneck in p.stage_seconds
    assert Plan.from_dict(json.loads(p.to_json())) == p


def test_preemptible_pools_do_not_train_unless_allowed():
  cluster = load_cluster(os.path.join(REPO, "configs", "clusters", "ondemand_preemptible.py"))
  model = get_preset("qwen3-8b")
  for options in build_problem(cluster, model, Workload()).train:
    assert options.island == ("h100",)
  allowed = build_problem(cluster, model, Workload(), train_on_preemptible=True)
  assert {o.island for o in allowed.train} == {("h100",), ("a100-spot",)}


def test_infeasible_requests_say_what_is_missing():
  local = load_cluster(os.path.join(REPO, "configs", "clusters", "local_cpu.py"), "static")
  with pytest.raises(PlanningError, match="fits no rollout configuration.*36.6 GiB|fits no"):
    build_problem(local, get_preset("qwen3-32b"), Workload())
  cluster = load_cluster(os.path.join(REPO, "configs", "clusters", "mixed_fast_cheap.py"))
  problem = build_problem(cluster, get_preset("qwen3-8b"), Workload())
  with pytest.raises(PlanningError, match=r"below the cheapest feasible plan.*\$"):
    plan(problem, PlannerConfig(budget_per_hour=1.0))
  with pytest.raises(PlanningError, match="no plan .* 1e\\+06 samples/s"):
    plan(problem, PlannerConfig(min_throughput=1e6))
  # The cheapest plan for a reachable throughput reaches it and costs less than the fastest.
  fastest = plan(problem)
  cheap = plan(problem, PlannerConfig(min_throughput=0.5 * fastest.throughput_samples_per_s))
  assert cheap.throughput_samples_per_s >= 0.5 * fastest.throughput_samples_per_s * (1 - 1e-6)
  assert cheap.cost_per_hour < fastest.cost_per_hour


def test_bad_cluster_specs_are_rejected_clearly():
  pool = {"name": "a", "accelerator": "H100", "nodes": 1}
  with pytest.raises(ValueError, match="unknown accelerator 'H1000'"):
    cluster_from_dict({"pools": [dict(pool, accelerator="H1000")]})
  with pytest.raises(ValueError, match="pool names must be unique"):
    cluster_from_dict({"pools": [pool, pool]})
  with pytest.raises(ValueError, match=r"pools\[0\] has unknown key"):
    cluster_from_dict({"pools": [dict(pool, gpus=8)]})
  with pytest.raises(ValueError, match="unknown field"):
    cluster_from_dict({"pools": [pool], "overrides": {"H100": {"tflops": 1}}})
  c = cluster_from_dict({"pools": [pool], "overrides": {"H100": {"price_on_demand": 1.5}}})
  assert c.price(c.pool("a")) == 1.5 and CATALOG["H100"].price_on_demand != 1.5


def test_training_islands_never_straddle_a_slow_link():
  pools = [
    {"name": "a", "accelerator": "H100", "nodes": 2, "inter_node_GBps": 50.0},
    {"name": "b", "accelerator": "H100", "nodes": 2, "inter_node_GBps": 50.0},
    {"name": "c", "accelerator": "H100", "nodes": 2, "inter_node_GBps": 50.0},
    {"name": "d", "accelerator": "A100-80GB", "nodes": 2, "inter_node_GBps": 50.0},
  ]
  # a-b share a fabric; c is reachable only over the slow default; d is another type.
  c = cluster_from_dict({"pools": pools, "links": [["a", "b", 50.0], ["a", "d", 50.0]]})
  assert c.training_islands() == [("a", "b"), ("c",), ("d",)]
  problem = build_problem(c, get_preset("qwen3-8b"), Workload())
  assert max(o.cost.devices for o in problem.train if o.island == ("a", "b")) == 32
  assert max(o.cost.devices for o in problem.train if o.island == ("c",)) == 16


def test_cost_model_shapes():
  model, acc = get_preset("qwen3-8b"), CATALOG["H100"]
  w = Workload()
  small, large = rollout_cost(model, acc, 1, 8, w), rollout_cost(model, acc, 1, 64, w)
  # Decode is memory-bound: 8x the batch costs far less than 8x the step time.
  assert small.step_seconds < large.step_seconds < 4 * small.step_seconds
  assert large.samples_per_s > 4 * small.samples_per_s
  assert rollout_cost(model, acc, 1, 4096, w) is None  # KV of 4096 sequences does not fit
  t8, t32 = (train_cost(model, acc, n, 8, 50e9, w) for n in (8, 32))
  assert 2.5 < t8.step_seconds / t32.step_seconds <= 4.0
  assert train_cost(model, acc, 1, 8, 50e9, w) is None  # 16 bytes/param of 8B on one GPU
  # A longer tail (same median) raises the tail latency and the KV a sequence holds.
  wide = dataclasses.replace(w, response_sigma=1.5)
  assert rollout_cost(model, acc, 1, 64, wide).tail_seconds > large.tail_seconds


def test_sliding_window_layers_hold_and_read_their_window_only():
  """Gemma 3 1B: 22 of 26 layers see 512 positions. At a context of 8,192 its sequences hold
  (4 x 8,192 + 22 x 512) / (26 x 8,192) of the KV they would without windows."""
  gemma = get_preset("gemma3-1b")
  full = dataclasses.replace(gemma, sliding_window=0, sliding_layers=(), local_rope_theta=0.0)
  assert len(gemma.sliding_layers) == 22
  ratio = cost_model.kv_bytes(gemma, 8192) / cost_model.kv_bytes(full, 8192)
  assert ratio == pytest.approx((4 * 8192 + 22 * 512) / (26 * 8192))
  assert cost_model.kv_bytes(gemma, 300) == cost_model.kv_bytes(full, 300)  # inside the window
  acc, w = CATALOG["H100"], Workload(prompt_len=1024, response_median=4096)
  windowed, dense = rollout_cost(gemma, acc, 1, 256, w), rollout_cost(full, acc, 1, 256, w)
  assert windowed.memory_bytes < 0.5 * dense.memory_bytes
  assert windowed.step_seconds < dense.step_seconds


def test_training_meshes_are_data_parallel_where_the_state_fits_each_replica():
  """A dense model whose training state fits one device trains data parallel (one gradient
  all-reduce an update, 2/3 of FSDP's bytes); one that does not, FSDP; MoE, never a data axis."""
  acc, w = CATALOG["H100"], Workload()
  small = train_cost(get_preset("qwen3-0.6b"), acc, 8, 8, 50e9, w)
  assert small.mesh["data"] > 1 and small.mesh["fsdp"] == 1
  assert small.mesh["data"] * small.mesh["tensor"] == 8
  large = train_cost(get_preset("qwen3-8b"), acc, 8, 8, 50e9, w)  # 128 GB of state
  assert large.mesh["data"] == 1 and large.mesh["fsdp"] > 1
  # The same devices as FSDP: more memory a device (the whole state), no slower a step.
  model, tensor = get_preset("qwen3-0.6b"), small.mesh["tensor"]
  tokens = w.samples_per_step * (w.prompt_len + w.lengths().mean)
  axes = (1, 8 // tensor, tensor, 1)
  fsdp = cost_model._train_mesh_cost(model, acc, 8, axes, 8, 50e9, w, tokens)
  assert fsdp.mesh["fsdp"] == 8 // tensor and fsdp.step_seconds >= small.step_seconds
  assert small.memory_bytes > fsdp.memory_bytes
  # Where the whole state would take over half a device (a v5e's 16 GiB), data parallel only
  # splits it over tensor first: room is left for a colocated engine.
  for name in ("H100", "v5e", "L4"):
    c = train_cost(model, CATALOG[name], 8, 8, 50e9, w)
    state = 16 * model.num_params() / (8 // c.mesh["data"])
    half = cost_model.DATA_PARALLEL_STATE_SHARE * USABLE_MEMORY * CATALOG[name].memory_bytes
    assert c.mesh["data"] == 1 or state <= half, (name, c.mesh)
  v5e = train_cost(model, CATALOG["v5e"], 8, 8, 50e9, w)
  assert v5e.mesh["data"] < 8
  moe = train_cost(get_preset("tiny-moe"), CATALOG["cpu"], 4, 4, 1e9, w)
  assert moe.mesh["data"] == 1
  # The micro-batch splits over data as over fsdp: 6 rows do not split over 4 replicas.
  odd = train_cost(get_preset("tiny"), CATALOG["cpu"], 4, 4, 1e9, Workload(micro_batch_size=6))
  assert odd.mesh == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}


def test_efficiency_fit_recovers_known_factors():
  model, acc = get_preset("bench-small"), CATALOG["cpu"]
  rng = np.random.default_rng()
  true_eff, true_overhead = rng.uniform(0.2, 0.9), rng.uniform(1e-4, 5e-3)
  steps = []
  for batch in (1, 4, 16, 64):
    roof = decode_roofline_seconds(model, acc, 1, batch, 256)
    steps.append((roof, true_overhead + roof / true_eff, 1.0))
  fitted = fit_decode_efficiency(acc, steps)
  assert fitted.decode_efficiency == pytest.approx(true_eff, rel=1e-6)
  assert fitted.step_overhead_s == pytest.approx(true_overhead, rel=1e-6)
  with pytest.raises(ValueError, match="two or more distinct"):
    fit_decode_efficiency(acc, steps[:1])


def test_256_devices_of_six_types_plan():
  cluster = _six(256)
  assert len({p.accelerator for p in cluster.pools}) == 6 and cluster.num_devices >= 240
  got = plan(build_problem(cluster, get_preset("qwen3-30b-a3b"), Workload(max_staleness=2)))
  assert got.throughput_samples_per_s > 0


def test_plan_cli_prints_json_and_errors_cleanly():
  cmd = [sys.executable, os.path.join(REPO, "launch", "plan.py"), "--model", "qwen3-8b"]
  cluster = ["--cluster", os.path.join(REPO, "configs", "clusters", "mixed_fast_cheap.py")]
  out = subprocess.run(cmd + cluster + ["--json"], capture_output=True, text=True, check=True)
  d = json.loads(out.stdout)
  assert {"stages", "throughput_samples_per_s", "cost_per_hour", "bottleneck"} <= set(d)
  bad = subprocess.run(cmd + cluster + ["--budget", "0.5"], capture_output=True, text=True)
  assert bad.returncode == 2 and "below the cheapest feasible plan" in bad.stderr


def test_a_solver_error_is_retried_not_reported_as_no_plan():
  """This random case makes HiGHS stop with "Solve error" (status 4) under presolve; the
  planner retries without presolve instead of reporting that no plan exists."""
  problem = _small_problem(np.random.default_rng(1552))
  got = plan(problem)
  best = exhaustive_best(problem)
  assert got.throughput_samples_per_s >= 0.99 * best.throughput_samples_per_s
