"""Plans which accelerators of a cluster serve rollout and which train; starts no job.

  python launch/plan.py --cluster configs/clusters/mixed_fast_cheap.py --model qwen3-8b
  python launch/plan.py --cluster configs/clusters/six_types.py:1024 --model qwen3-30b-a3b \
      --budget 300 --json
  python launch/plan.py --cluster configs/clusters/ondemand_preemptible.py --model qwen3-8b \
      --min_throughput 20      # the cheapest plan that reaches 20 samples/s

`--cluster FILE[:ARG]` passes ARG to the file's get_config. The workload flags describe one
RL step (prompts x group responses, lognormal response lengths, staleness bound).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from jaxrl.model import PRESETS, get_preset  # noqa: E402
from jaxrl.scheduler import (  # noqa: E402
  PlannerConfig,
  PlanningError,
  Workload,
  build_problem,
  load_cluster,
  plan,
)
from jaxrl.scheduler.planner import plan_colocated  # noqa: E402


def workload_flags(parser: argparse.ArgumentParser) -> None:
  """The `Workload` fields as flags."""
  defaults = Workload()
  for name, kind, help_ in (
    ("prompts_per_step", int, "prompts per training step"),
    ("group_size", int, "responses per prompt"),
    ("prompt_len", int, "tokens per prompt"),
    ("response_median", float, "median response length (lognormal)"),
    ("response_sigma", float, "lognormal sigma of response lengths"),
    ("response_cap", int, "maximum response length"),
    ("max_staleness", int, "staleness bound in versions (0: synchronous)"),
    ("updates_per_step", int, "optimizer updates per step"),
    ("extra_forward_passes", int, "reference / proximal log-prob passes"),
    ("micro_batch_size", int, "training micro-batch the mesh's batch axes divide (0: any)"),
  ):
    parser.add_argument(f"--{name}", type=kind, default=getattr(defaults, name), help=help_)


def workload_from_args(args: argparse.Namespace) -> Workload:
  fields = Workload.__dataclass_fields__
  return Workload(**{k: getattr(args, k) for k in fields})


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--cluster", required=True, help="configs/clusters/<name>.py[:arg]")
  parser.add_argument("--model", required=True, help=f"model preset: {sorted(PRESETS)}")
  parser.add_argument("--budget", type=float, default=math.inf, help="$/hour limit")
  parser.add_argument(
    "--min_throughput", type=float, default=0.0, help="samples/s to reach at least cost"
  )
  parser.add_argument("--train_on_preemptible", action="store_true")
  parser.add_argument("--colocated", action="store_true", help="plan colocated stages instead")
  parser.add_argument("--json", action="store_true", help="print the plan as JSON")
  workload_flags(parser)
  args = parser.parse_args(argv)
  path, _, arg = args.cluster.partition(":")
  try:
    cluster = load_cluster(path, arg or None)
    model = get_preset(args.model)
    problem = build_problem(
      cluster,
      model,
      workload_from_args(args),
      model_name=args.model,
      train_on_preemptible=args.train_on_preemptible,
    )
    config = PlannerConfig(budget_per_hour=args.budget, min_throughput=args.min_throughput)
    result = plan_colocated(problem) if args.colocated else plan(problem, config)
  except (PlanningError, ValueError, FileNotFoundError) as e:
    print(f"plan: {e}", file=sys.stderr)
    return 2
  print(result.to_json(indent=2) if args.json else result.table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
