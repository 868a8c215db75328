"""Simulates an RL job on a cluster under several scheduling policies and compares them.

  python launch/simulate.py --cluster configs/clusters/ondemand_preemptible.py --model qwen3-8b \
      --policies colocated_sync,disagg_sync,disagg_async,disagg_async_partial,\
disagg_async_partial_spot --steps 20 --trace random --out runs/simulate

Each policy is planned (colocated, or disaggregated sync / async) and run through the
discrete-event simulator (jaxrl/scheduler/simulator.py). `--cluster FILE[:ARG]` passes ARG to
the file's get_config. `--trace` is `none`, `random` (shrink / grow events of the cluster's
first preemptible pool) or a JSON file: a list of {"time_s", "pool", "nodes", "notice_s"}.
Writes DIR/comparison.png, DIR/timeline_<policy>.png and DIR/results.json.
"""

import dataclasses
import json
import os
import sys

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from jaxrl.scheduler.simulator import POLICIES  # noqa: E402

_CLUSTER = flags.DEFINE_string(
  "cluster",
  os.path.join(_REPO, "configs", "clusters", "ondemand_preemptible.py"),
  "Cluster file, configs/clusters/<name>.py[:arg].",
)
_MODEL = flags.DEFINE_string("model", "qwen3-8b", "Model preset (jaxrl.model.PRESETS).")
_POLICIES = flags.DEFINE_list("policies", list(POLICIES), f"Policies to compare: {POLICIES}.")
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps per policy.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of response lengths and of the random trace.")
_TRACE = flags.DEFINE_string("trace", "random", "none, random, or a JSON file of pool events.")
_TRACE_INTERVAL = flags.DEFINE_float(
  "trace_interval", 0.0, "Mean seconds between random events (0: a few per predicted run)."
)
_WINDOW = flags.DEFINE_float("window_s", 600.0, "Seconds a re-plan must pay back within.")
_ORACLE = flags.DEFINE_bool(
  "oracle_ranker", False, "Dispatch longest requests first to the fastest instances."
)
_OUT = flags.DEFINE_string("out", os.path.join("runs", "simulate"), "Output directory.")
# The workload of one RL step.
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 64, "Prompts per training step.")
_GROUP = flags.DEFINE_integer("group_size", 8, "Responses per prompt.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Tokens per prompt.")
_MEDIAN = flags.DEFINE_float("response_median", 1024, "Median response length (lognormal).")
_SIGMA = flags.DEFINE_float("response_sigma", 1.0, "Lognormal sigma of response lengths.")
_CAP = flags.DEFINE_integer("response_cap", 8192, "Maximum response length.")
_STALENESS = flags.DEFINE_integer(
  "max_staleness", 2, "Staleness bound of the async policies (sync policies use 0)."
)


def _trace(problem, policies):
  from jaxrl.scheduler.replan import PoolEvent
  from jaxrl.scheduler.simulator import policy_plan, random_trace

  value = _TRACE.value
  if value == "none":
    return []
  if value != "random":
    with open(value) as f:
      events = json.load(f)
    events = events["events"] if isinstance(events, dict) else events
    return [PoolEvent(**e) for e in events]
  spot = [p for p in problem.cluster.pools if p.preemptible and p.nodes]
  if not spot:
    print(
      "simulate: the cluster has no preemptible pool; running without a trace.", file=sys.stderr
    )
    return []
  policy = next((p for p in policies if p.endswith("_spot")), policies[0])
  predicted = policy_plan(problem, policy)[1].cycle_seconds * _STEPS.value
  interval = _TRACE_INTERVAL.value or predicted / 4
  return random_trace(problem.cluster, spot[0].name, 20 * predicted, interval, seed=_SEED.value)


def _table(results) -> str:
  head = (
    f"{'policy':<27} {'samples/s':>9} {'(model)':>8} {'$/1k smp':>9} {'(model)':>8} "
    f"{'roll util':>9} {'train util':>10} {'staleness':>9} {'off-pol tok':>11} "
    f"{'preempt':>7} {'replans':>7}"
  )
  lines = [head, "-" * len(head)]
  for r in results:
    lines.append(
      f"{r.policy:<27} {r.samples_per_s:>9.3g} {r.plan_samples_per_s:>8.3g} "
      f"{r.cost_per_1k_samples:>9.3g} {r.plan_cost_per_1k_samples:>8.3g} "
      f"{r.utilisation['rollout']:>9.2f} {r.utilisation['train']:>10.2f} "
      f"{r.mean_staleness:>9.2f} {r.off_policy_token_fraction:>11.2f} {r.preemptions:>7} "
      f"{f'{r.replans_adopted}/{r.replans}':>7}"
    )
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    sys.exit(f"simulate: unexpected arguments {argv[1:]}")
  policies = [p.strip() for p in _POLICIES.value if p.strip()]
  unknown = [p for p in policies if p not in POLICIES]
  if unknown or not policies:
    sys.exit(
      f"simulate: unknown policy {unknown or policies}; known policies: {', '.join(POLICIES)}."
    )
  from jaxrl.model import get_preset
  from jaxrl.scheduler import PlanningError, Workload, build_problem, load_cluster
  from jaxrl.scheduler.simulator import simulate
  from jaxrl.scheduler.timeline import plot_comparison, plot_timeline

  path, _, arg = _CLUSTER.value.partition(":")
  try:
    workload = Workload(
      prompts_per_step=_PROMPTS.value,
      group_size=_GROUP.value,
      prompt_len=_PROMPT_LEN.value,
      response_median=_MEDIAN.value,
      response_sigma=_SIGMA.value,
      response_cap=_CAP.value,
      max_staleness=_STALENESS.value,
    )
    cluster = load_cluster(path, arg or None)
    problem = build_problem(cluster, get_preset(_MODEL.value), workload, model_name=_MODEL.value)
    trace = _trace(problem, policies)
    results = [
      simulate(
        problem,
        policy,
        _STEPS.value,
        seed=_SEED.value,
        trace=trace,
        window_s=_WINDOW.value,
        oracle_ranker=_ORACLE.value,
      )
      for policy in policies
    ]
  except (PlanningError, ValueError, FileNotFoundError, KeyError, TypeError) as e:
    sys.exit(f"simulate: {e}")
  print(
    f"{_MODEL.value} on {cluster.name}: {_STEPS.value} steps of {workload.samples_per_step} "
    f"samples, {len(trace)} availability events"
  )
  print(_table(results))
  os.makedirs(_OUT.value, exist_ok=True)
  plot_comparison(results, os.path.join(_OUT.value, "comparison.png"))
  for r in results:
    plot_timeline(r, os.path.join(_OUT.value, f"timeline_{r.policy}.png"))
  summary = {
    "cluster": cluster.name,
    "model": _MODEL.value,
    "steps": _STEPS.value,
    "workload": dataclasses.asdict(workload),
    "trace": [dataclasses.asdict(e) for e in trace],
    "results": [r.to_dict() for r in results],
  }
  with open(os.path.join(_OUT.value, "results.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {_OUT.value}/comparison.png, timeline_<policy>.png, results.json")


if __name__ == "__main__":
  app.run(main)
