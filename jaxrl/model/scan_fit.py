"""`ModelConfig.scan_layers` where it is worth its memory: `fit_scan`.

A scan over the blocks stacks a copy of their weights, in the compute dtype, inside the
program, and a training pass also their stacked gradient (`Transformer._scan_blocks`). For
Qwen3-0.6B each is 0.82 GiB. For gpt-oss-20b on one H100 each is about 36 GiB: compiled for
the card, a 2k-token learner micro-step planned 77.0 GiB of temporaries scanned against 4.75
unrolled, and the rollout engine's packed prefill 34.7 against 0.32, beside 38.9 GiB of
weights and KV pool (docs/BENCHMARKS.md, `launch/bench.py moe_layer --target h100`). What the
scan buys is compile time (the learner's update compiled 2.3-2.4x as fast there), which is not
worth a large share of a device. The learner and the paged engine therefore keep the scan
only where its copies fit in `SCAN_MEMORY_SHARE` of a device's memory, as the device reports
it (GPUs and TPUs); a CPU reports none, and the setting stays as configured.
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


def fit_scan(model: Model, mesh: jax.sharding.Mesh, shardings, copies: int) -> Model:
  """`model`, or the same model with `scan_layers` off where `copies` stacked copies of its
  blocks' weights (2 for training: the weights and their gradient; 1 for a packed prefill)
  would take more than `SCAN_MEMORY_SHARE` of a device of `mesh`."""
  cfg = model.config
  if not cfg.scan_layers:
    return model
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
