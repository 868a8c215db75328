"""One RL batch as the learner takes it, on the host."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class TrainBatch:
  """Host arrays of one RL batch; position t of every `_bt` array scores token t + 1.

  Attributes:
    tokens_bt: [b, t + 1] prompt + response ids, right-padded.
    mask_bt: [b, t] 1 where the target (token t + 1) is a response token.
    old_logp_bt: [b, t] behaviour log-probs of the targets (the rollout's), 0 off the mask.
    advantages_b: [b] one advantage per sequence.
    routes_btlk: MoE: int32 [b, t, layers, k] the experts rollout routed each input token to
      (for routing replay; -1 at padding positions), or None.
  """

  tokens_bt: np.ndarray
  mask_bt: np.ndarray
  old_logp_bt: np.ndarray
  advantages_b: np.ndarray
  routes_btlk: np.ndarray | None = None

  @classmethod
  def blank(cls, batch_size: int, length: int, routes_lk: tuple[int, int] | None = None):
    """`batch_size` sequences of `length` tokens, none trained on (all padding), for compiling
    an update's shapes; `routes_lk` (layers, k): with routes, all -1 (padding)."""
    routes = None if routes_lk is None else np.full((batch_size, length - 1, *routes_lk), -1)
    return cls(
      tokens_bt=np.zeros((batch_size, length), np.int32),
      mask_bt=np.zeros((batch_size, length - 1), np.float32),
      old_logp_bt=np.zeros((batch_size, length - 1), np.float32),
      advantages_b=np.zeros((batch_size,), np.float32),
      routes_btlk=routes,
    )

  @property
  def size(self) -> int:
    return self.tokens_bt.shape[0]

  def split(self, parts: int) -> list[TrainBatch]:
    """The batch as `parts` runs of consecutive rows, one per optimizer update (the learner's
    split of a step's batch); rows an uneven split leaves over form one more part."""
    rows = max(self.size // parts, 1)
    return [
      TrainBatch(
        *(None if x is None else x[start : start + rows] for x in dataclasses.astuple(self))
      )
      for start in range(0, self.size, rows)
    ]
