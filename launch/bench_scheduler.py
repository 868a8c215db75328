"""`python launch/bench.py plan` and `calibrate`: the scheduler's planner solve time, and its
decode cost model fitted to this CPU.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from bench_profile import decode_step_seconds  # launch/ is on sys.path

from jaxrl.model import Model, get_preset
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, make_mesh


def bench_plan(
  sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024),
  models: tuple[str, ...] = ("qwen3-8b", "qwen3-30b-a3b"),
  repeats: int = 3,
) -> dict:
  """Planner solve time (candidate enumeration + MILP) on six-type clusters of 16-1024 devices.

  Best of `repeats` wall times per (size, model, staleness), with the plan's throughput and
  the number of candidate rollout and training configurations the MILP chose from.
  """
  from jaxrl.scheduler import PlannerConfig, Workload, build_problem, load_cluster, plan

  out = {}
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  for size in sizes:
    cluster = load_cluster(os.path.join(path, "clusters", "six_types.py"), str(size))
    for name in models:
      for staleness in (0, 2):
        best, result = float("inf"), None
        for _ in range(repeats):
          start = time.perf_counter()
          problem = build_problem(
            cluster, get_preset(name), Workload(max_staleness=staleness), model_name=name
          )
          result = plan(problem, PlannerConfig())
          best = min(best, time.perf_counter() - start)
        out[f"{size}/{name}/staleness{staleness}"] = {
          "devices": cluster.num_devices,
          "types": len({p.accelerator for p in cluster.pools}),
          "solve_seconds": best,
          "rollout_candidates": len(problem.rollout),
          "train_candidates": len(problem.train),
          "throughput_samples_per_s": result.throughput_samples_per_s,
          "cost_per_hour": result.cost_per_hour,
          "bottleneck": result.bottleneck,
        }
  return out


def bench_calibrate(
  presets: tuple[str, ...] = ("bench-tiny", "bench-small"),
  batches: tuple[int, ...] = (1, 4, 16, 64),
  prompt_len: int = 32,
  new_tokens: int = 64,
) -> dict:
  """Fits the scheduler's decode efficiency and per-step overhead for this CPU to measured
  steady-state decode steps of the paged engine (one device = the whole machine)."""
  from jaxrl.scheduler import calibrate_cpu, fit_decode_efficiency
  from jaxrl.scheduler.cost import decode_roofline_seconds

  machine = calibrate_cpu(devices_sharing=1)
  rng = np.random.default_rng(0)
  steps, rows = [], {}
  context = prompt_len + new_tokens / 2
  for preset in presets:
    cfg = get_preset(preset)
    model = Model(cfg)
    engine = PagedEngine(
      model,
      make_mesh(jax.devices()[:1], {}),
      ROLLOUT_RULES,
      eos_id=2,
      pad_id=0,
      config=PagedConfig(page_size=16, num_pages=max(batches) * 8, max_running=max(batches)),
    )
    engine.update_weights(model.init(0), 0)
    for batch in batches:
      prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(batch)]
      sampling = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * batch
      measured = decode_step_seconds(engine, prompts, sampling)
      roof = decode_roofline_seconds(cfg, machine, 1, batch, context)
      steps.append((roof, measured, 1.0 / measured**2))  # relative error, not absolute
      rows[f"{preset}/batch{batch}"] = {"measured_ms": measured * 1e3, "roofline_ms": roof * 1e3}
  fitted = fit_decode_efficiency(machine, steps)
  for (roof, _, _), row in zip(steps, rows.values(), strict=True):
    row["model_ms"] = (fitted.step_overhead_s + roof / fitted.decode_efficiency) * 1e3
  return {
    "machine": {
      "memcpy_GBps": machine.hbm_bytes_per_s / 1e9,
      "matmul_GFLOPs": machine.flops / 1e9,
      "decode_efficiency": fitted.decode_efficiency,
      "step_overhead_ms": fitted.step_overhead_s * 1e3,
    },
    **rows,
  }
