"""The expert-parallel layer's documented drop rule, in numpy, independently of its code
(`jaxrl.sharding.expert`): each device (a contiguous block of tokens) takes its assignments in
order (k, token) and keeps, for each receiving device, the first `capacity` of its real rows'
assignments; padding rows (`valid_t` False) send nothing and do not count towards capacity."""

from __future__ import annotations

import math

import numpy as np


def capacity(rows: int, k: int, slots: int, e: int, capacity_factor: float) -> int:
  """Assignments a device of `rows` real rows may send one receiver."""
  return min(rows * min(k, slots), max(1, math.ceil(capacity_factor * rows * k / e)))


def kept(routes_tk, shards: int, slots: int, e: int, capacity_factor: float, valid_t=None):
  """bool [t, k]: which assignments the layer keeps (False for padding rows)."""
  tokens, k = routes_tk.shape
  n = tokens // shards
  valid_t = np.ones(tokens, bool) if valid_t is None else np.asarray(valid_t, bool)
  keep_tk = np.zeros(routes_tk.shape, bool)
  for shard in range(shards):
    rows = range(shard * n, (shard + 1) * n)
    room = capacity(int(valid_t[rows.start : rows.stop].sum()), k, slots, e, capacity_factor)
    sent = np.zeros(e, int)
    for kk in range(k):
      for t in rows:
        if not valid_t[t]:
          continue
        dest = routes_tk[t, kk] // slots
        keep_tk[t, kk] = sent[dest] < room
        sent[dest] += 1
  return keep_tk
