"""Decoupled PPO's proximal policy: the current weights' log-probs of a batch, computed one
micro-batch at a time exactly as the learner's update computes them (the same micro-batches,
real positions and expert placements: with an expert capacity, the same drops), so that the
first update of a step starts at ratio 1 (`Learner.proximal_logprobs`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl.train.batch import TrainBatch
from jaxrl.train.packing import input_positions


def micro_placement(placement_m, i: int):
  """Micro-batch `i`'s expert placement of stacked ones (`Learner._plan`), or None."""
  return None if placement_m is None else jax.tree.map(lambda x: x[i], placement_m)


def proximal_logprobs(learner, batch: TrainBatch) -> np.ndarray:
  """`[b, t]` log-probs of the batch's targets under `learner.params`, 0 off the mask."""
  routes_btlk = learner._replayed_routes(batch)
  if learner.pack_length:
    # Each optimizer update's rows packed apart, as `Learner.update` packs them: packed all at
    # once, the sequences met others in their micro-batches, and with an expert capacity other
    # drops (the first update of a step started away from ratio 1).
    parts = []
    routed = dataclasses.replace(batch, routes_btlk=routes_btlk)
    for part in routed.split(learner.updates_per_step):
      layout, packed = learner._pack(part, part.old_logp_bt)
      placement_m, _ = learner._plan(packed.routes_btlk)
      chunks = [
        learner._packed_logprobs(learner.params, micro, micro_placement(placement_m, i))
        for i, micro in enumerate(learner._put_micro_batches(packed))
      ]  # all dispatched before any is read
      parts.append((layout, chunks))
    out = []
    for layout, chunks in parts:
      packed_logp = np.stack([np.asarray(c) for c in chunks]) if chunks else np.zeros(layout.shape)
      out.append(layout.scatter(packed_logp.astype(np.float32)))
    return np.concatenate(out) * (batch.mask_bt > 0)
  mbs = learner.micro_batch_size
  stacked = None if routes_btlk is None else routes_btlk.reshape(-1, mbs, *routes_btlk.shape[1:])
  placement_m, _ = learner._plan(stacked)
  chunks = []
  for m, i in enumerate(range(0, batch.size, mbs)):
    valid_bt = input_positions(batch.mask_bt[i : i + mbs]) if learner._capacity else None
    routes = None if routes_btlk is None else routes_btlk[i : i + mbs]
    tokens_bt = np.asarray(batch.tokens_bt[i : i + mbs])  # host data: global in any process
    placement = micro_placement(placement_m, m)
    chunks.append(learner._logprobs(learner.params, tokens_bt, routes, valid_bt, placement))
  return np.concatenate([np.asarray(c) for c in chunks]) * (batch.mask_bt > 0)
