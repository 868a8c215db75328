"""A step's metrics: those of its optimizer updates averaged, in one program.

Averaged leaf by leaf in Python, a step dispatched two small programs per metric (about 50 for
a dense model), each over every device of the training mesh, behind the update's own. On a CPU
with simulated devices that deep a queue of multi-device programs can stall XLA's in-process
collectives (jax 0.10.2, 2 cores, 4 devices: a jitted all-reduce and an elementwise program
called in turn, synchronised every 32 calls of each, waited 40 s at the all-reduce and aborted
the process; every 16, it ran). A Ray learner actor with the suite's XLA flags aborted so 1-2
times a run (`tests/launch_test.py`), and none in 5 runs since. On an accelerator one program
is also one dispatch instead of 50.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def average_update_metrics(all_metrics: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
  """The mean of each metric over the updates, `skipped` summed, MoE routing counts as the share
  of assignments dropped, and the behaviour weights' effective sample size (a fraction of the
  tokens)."""
  out = jax.tree.map(lambda *xs: sum(xs) / len(xs), *all_metrics)
  if "moe_routed" in out:  # MoE with a capacity: the share of assignments it dropped
    routed, dropped = out.pop("moe_routed"), out.pop("moe_dropped")
    out["moe_dropped_frac"] = dropped / jnp.maximum(routed, 1)
  ess = out["behaviour_weight_mean"] ** 2 / jnp.maximum(out["behaviour_weight_sq_mean"], 1e-30)
  return out | {"skipped": sum(m["skipped"] for m in all_metrics), "behaviour_ess": ess}
