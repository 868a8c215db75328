"""`python launch/bench.py balance`: MoE expert placement planners on synthetic routing traces.

Each token of a micro-batch picks `top_k` distinct experts, sampled without replacement (Gumbel
top-k) from a Zipf popularity `1 / rank**a` over a random permutation of the experts, one
permutation per layer. The exponent `a` is bisected per layer so that the static (home)
placement's device imbalance, max / mean device load, hits the target (1.3, 2, 4) on the sampled
trace. Where no exponent reaches it (with top-8 routing over 8 devices, popularity alone gives a
device about 3x the mean at most, unless it hosts several of the hottest experts), the hottest
experts are first gathered onto the hottest device, one swap at a time (`gathered` counts the
swaps).

For every (experts, devices) x target x method x redundant slots per device: the imbalance
before (static) and after, the redundant slots filled, the expert weights copied from the home
placement (slots and bytes, for a Qwen3-30B-A3B expert), and the planning time per layer
(median over repeats, host CPU). Then the next micro-batch from the same popularity: the
imbalance the plan gives it unchanged (stale), and replanned with `previous=` the plan, with
the slots that copies. Targets: imbalance <= 1.05 with at most 1 redundant slot per
device, and planning under 10 ms per layer for 256 experts x 64 devices.

  python launch/bench.py balance --json   # one JSON object
"""

from __future__ import annotations

import json
import time

import numpy as np

from jaxrl.sharding import METHODS, bytes_moved, device_loads, imbalance, plan_placement

CONFIGS = ((64, 8), (128, 16), (256, 64))  # (experts, devices)
TARGETS = (1.3, 2.0, 4.0)
REDUNDANT_SLOTS = (1, 2)
TOP_K = 8
# Qwen3-30B-A3B: hidden 2048, expert intermediate 768, gate + up + down projections in bf16.
BYTES_PER_EXPERT = 3 * 2048 * 768 * 2
TARGET_IMBALANCE = 1.05
TARGET_PLAN_MS = 10.0
_MAX_EXPONENT = 8.0  # Beyond it every token already picks the same top-k experts.


def _topk_loads(exponent: float, rank_x: np.ndarray, gumbel_tx: np.ndarray) -> np.ndarray:
  """Tokens per expert when each token takes the top-k of log-popularity + Gumbel noise."""
  scores_tx = gumbel_tx - np.float32(exponent) * np.log(rank_x).astype(np.float32)
  picks = np.argpartition(-scores_tx, TOP_K - 1, axis=1)[:, :TOP_K]
  return np.bincount(picks.ravel(), minlength=rank_x.size).astype(np.float64)


def _static_imbalance(load_x: np.ndarray, num_devices: int) -> float:
  return float(imbalance(load_x.reshape(num_devices, -1).sum(1)))


def routing_layer(
  rng: np.random.Generator, num_experts: int, num_devices: int, target: float, tokens: int
) -> tuple[np.ndarray, np.ndarray, dict]:
  """One layer's tokens per expert whose static imbalance is `target` (within 0.2%).

  Returns:
    (load_x, next_load_x, info): the calibrated micro-batch, the next micro-batch from the same
    popularity (fresh noise, so its imbalance is near but not at the target), and the exponent
    and the number of gathering swaps.
  """
  # Common random numbers: the same noise for every exponent, so the imbalance is a
  # deterministic function of the exponent and bisection works on it.
  gumbel_tx = rng.gumbel(size=(tokens, num_experts)).astype(np.float32)
  rank_x = rng.permutation(num_experts) + 1.0
  per = num_experts // num_devices

  def static(exponent):
    return _static_imbalance(_topk_loads(exponent, rank_x, gumbel_tx), num_devices)

  def bracket():
    """The first step of 0.25 over which the imbalance crosses the target, if any."""
    for hi in np.arange(0.25, _MAX_EXPONENT + 0.125, 0.25):
      if static(hi) >= target:
        return hi - 0.25, hi
    return None

  gathered = 0
  while (found := bracket()) is None:
    if gathered == per:
      raise RuntimeError(f"No trace reaches imbalance {target} with {num_experts} experts.")
    load_d = _topk_loads(_MAX_EXPONENT, rank_x, gumbel_tx).reshape(num_devices, per).sum(1)
    hot = int(np.argmax(load_d))
    on = np.arange(hot * per, (hot + 1) * per)
    off = np.setdiff1d(np.arange(num_experts), on)
    coldest, hottest = on[np.argmax(rank_x[on])], off[np.argmin(rank_x[off])]
    rank_x[coldest], rank_x[hottest] = rank_x[hottest], rank_x[coldest]
    gathered += 1
  lo, hi = found
  best, best_value = hi, static(hi)
  for _ in range(40):
    if abs(best_value - target) <= 0.002 * target:
      break
    mid = (lo + hi) / 2
    value = static(mid)
    if abs(value - target) < abs(best_value - target):
      best, best_value = mid, value
    lo, hi = (mid, hi) if value < target else (lo, mid)
  load_x = _topk_loads(best, rank_x, gumbel_tx)
  next_load_x = _topk_loads(best, rank_x, rng.gumbel(size=gumbel_tx.shape).astype(np.float32))
  return load_x, next_load_x, {"exponent": best, "gathered": gathered}


def _median_ms(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def bench_balance(tokens: int = 16384, layers: int = 4, repeats: int = 9, seed: int = 0) -> dict:
  """Imbalance, slots, bytes moved and planning time per placement method; JSON-serialisable.

  Args:
    tokens: tokens per micro-batch, each routed to `TOP_K` distinct experts.
    layers: MoE layers per trace, each with its own expert permutation.
    repeats: planning runs per case; the median is reported.
    seed: seeds every trace.

  Returns:
    `{"setup": ..., "trace <X>x<D> imb<target>": ..., "<X>x<D> imb<target> <method> r<R>": ...,
    "summary": ...}`, each a flat dict (lists only for per-layer values).
  """
  out = {
    "setup": {
      "tokens": tokens,
      "top_k": TOP_K,
      "layers": layers,
      "repeats": repeats,
      "seed": seed,
      "bytes_per_expert": BYTES_PER_EXPERT,
      "expert": "Qwen3-30B-A3B expert: gate, up, down 3 x 2048 x 768 bf16",
      "target_imbalance": TARGET_IMBALANCE,
      "target_plan_ms_256x64": TARGET_PLAN_MS,
    }
  }
  within = {(m, r): [] for m in METHODS for r in REDUNDANT_SLOTS}
  plan_ms_256x64 = {m: 0.0 for m in METHODS}
  for num_experts, num_devices in CONFIGS:
    for target in TARGETS:
      loads, next_loads, traces = [], [], []
      for layer in range(layers):
        rng = np.random.default_rng([seed, num_experts, num_devices, round(target * 10), layer])
        load_x, next_load_x, trace = routing_layer(rng, num_experts, num_devices, target, tokens)
        loads.append(load_x)
        next_loads.append(next_load_x)
        traces.append(trace)
      loads_lx, next_loads_lx = np.stack(loads), np.stack(next_loads)
      name = f"{num_experts}x{num_devices} imb{target:g}"
      static_l = plan_placement(loads_lx, num_devices, 0, "static").imbalance_l
      out[f"trace {name}"] = {
        "static_imbalance_min": float(static_l.min()),
        "static_imbalance_max": float(static_l.max()),
        "exponent_l": [round(t["exponent"], 4) for t in traces],
        "gathered_l": [t["gathered"] for t in traces],
      }
      for method in METHODS:
        for redundant in REDUNDANT_SLOTS:
          args = (loads_lx, num_devices, redundant, method)
          p = plan_placement(*args)
          ms = _median_ms(lambda args=args: plan_placement(*args), repeats) / layers
          after_l = p.imbalance_l
          replan = plan_placement(next_loads_lx, num_devices, redundant, method, previous=p)
          within[method, redundant] += (after_l <= TARGET_IMBALANCE).tolist()
          if (num_experts, num_devices) == (256, 64):
            plan_ms_256x64[method] = max(plan_ms_256x64[method], ms)
          out[f"{name} {method} r{redundant}"] = {
            "imbalance_before": float(static_l.mean()),
            "imbalance_after": float(after_l.mean()),
            "imbalance_after_max": float(after_l.max()),
            "layers_within_target": float(np.mean(after_l <= TARGET_IMBALANCE)),
            "redundant_slots_used": float(
              np.mean((p.slot_expert_lds >= 0).sum((1, 2)) - num_experts)
            ),
            "redundant_slots": num_devices * redundant,
            "moved_slots": float(p.moved_slots_l.mean()),
            "bytes_moved_per_layer": bytes_moved(p, BYTES_PER_EXPERT) / layers,
            "plan_ms_per_layer": ms,
            "next_batch_imbalance_stale": float(imbalance(device_loads(p, next_loads_lx)).mean()),
            "next_batch_imbalance_replanned": float(replan.imbalance_l.mean()),
            "next_batch_moved_slots": float(replan.moved_slots_l.mean()),
            "imbalance_after_l": [round(v, 4) for v in after_l.tolist()],
          }
  out["summary"] = {
    **{
      f"{m} r{r} layers_within_target": float(np.mean(v))
      for (m, r), v in within.items()
      if m != "static"
    },
    **{f"plan_ms_256x64 {m} worst": v for m, v in plan_ms_256x64.items()},
    "plan_ms_target_met": max(plan_ms_256x64.values()) < TARGET_PLAN_MS,
  }
  return out


if __name__ == "__main__":
  print(json.dumps(bench_balance()))
