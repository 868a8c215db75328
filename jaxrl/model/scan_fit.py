"""`ModelConfig.scan_layers` where it is worth its memory and safe: `fit_scan`.

A scan over the blocks stacks a copy of their weights, in the compute dtype, inside the
program, and a training pass also their stacked gradient (`Transformer._scan_blocks`). For
Qwen3-0.6B each is 0.82 GiB. For gpt-oss-20b on one H100 each is about 36 GiB: compiled for
the card, a 2k-token learner micro-step planned 77.0 GiB of temporaries scanned against 4.75
unrolled, and the rollout engine's packed prefill 34.7 against 0.32, beside 38.9 GiB of
weights and KV pool (docs/BENCHMARKS.md, `launch/bench.py moe_layer --target h100`). What the
scan buys is compile time (the learner's update compiled 2.3-2.4x as fast there), which is not
worth a large share of a device. The learner and the paged engine therefore keep the scan
only where its copies fit in `SCAN_MEMORY_SHARE` of a device's memory, as the device reports
it (GPUs and TPUs); a CPU reports none.

On a mesh of several CPU devices whose programs exchange data (an axis other than `data`
over more than one device), the learner runs the blocks unrolled whatever the memory: XLA:CPU
(jax 0.10.2) orders a collective that follows the scan, without depending on it, by scheduling
alone, and in a program's first runs two simulated devices sometimes ran the two in opposite
orders and deadlocked (`jaxrl.train.update_plan.collectives_racing_loops` finds such
collectives; the LM head's all-gathers after the scan in the learner's micro-step are some).
The paged engine keeps its scan there: none of its programs has such a collective, scanned
(`tests/rollout/compile_ahead_test.py` checks them). Accelerators run collectives in program
order.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jaxrl.model.functional import Model

log = logging.getLogger(__name__)

SCAN_MEMORY_SHARE = 0.1
"""The share of a device's memory that the scan's stacked copies may take."""


def stacked_copy_bytes(model: Model, shardings) -> int:
  """Bytes that one device holds of one stacked copy of the blocks' weights in the compute
  dtype, each weight split as `shardings` (laid out like the parameters) splits it."""
  itemsize = jnp.dtype(model.config.dtype).itemsize
  shapes = jax.tree.leaves(model.abstract_params()["blocks"])
  parts = jax.tree.leaves(shardings["blocks"])
  return sum(
    math.prod(part.shard_shape(leaf.shape)) * itemsize
    for leaf, part in zip(shapes, parts, strict=True)
  )


def device_memory(device) -> int | None:
  """The bytes `device`'s allocator may use (`memory_stats()["bytes_limit"]`), or None where
  it does not say (CPU, devices compiled for without them)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (a device that cannot report is one that does not)
    return None
  return (stats or {}).get("bytes_limit")


def exchanges_on_cpu(mesh: jax.sharding.Mesh) -> bool:
  """Whether `mesh` is CPU devices whose programs run collectives: an axis but `data` spans
  more than one (a data-parallel program exchanges nothing until its replicas' sums meet)."""
  cpu = mesh.devices.flat[0].platform == "cpu"
  return cpu and any(size > 1 for axis, size in mesh.shape.items() if axis != "data")


def fit_scan(
  model: Model, mesh: jax.sharding.Mesh, shardings, copies: int, *, races_on_cpu: bool = False
) -> Model:
  """`model`, or the same model with `scan_layers` off where `copies` stacked copies of its
  blocks' weights (2 for training: the weights and their gradient; 1 for a packed prefill)
  would take more than `SCAN_MEMORY_SHARE` of a device of `mesh`, or, for programs whose
  collectives race the scan (`races_on_cpu`: the learner's), where `mesh` is CPU devices that
  exchange data (`exchanges_on_cpu`; the module's docstring says why)."""
  cfg = model.config
  if not cfg.scan_layers:
    return model
  if races_on_cpu and exchanges_on_cpu(mesh):
    log.info(
      "model.scan_layers off: on several CPU devices XLA:CPU can deadlock a program that runs "
      "collectives in and after a scan over the blocks; the blocks run unrolled."
    )
    return Model(dataclasses.replace(cfg, scan_layers=False))
  limit = device_memory(mesh.devices.flat[0])
  if limit is None:
    return model
  need = copies * stacked_copy_bytes(model, shardings)
  if need <= SCAN_MEMORY_SHARE * limit:
    return model
  log.info(
    "model.scan_layers off: its stacked copies of the blocks' weights would take %.1f GiB of a "
    "device's %.1f GiB (more than %.0f%%); the blocks run unrolled, which compiles slower.",
    need / 2**30, limit / 2**30, 100 * SCAN_MEMORY_SHARE,
  )  # fmt: skip
  return Model(dataclasses.replace(cfg, scan_layers=False))
