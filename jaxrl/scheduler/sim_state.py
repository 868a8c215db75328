"""State of the simulator's rollout side: waiting queue, requests and instances.

Plain mutable records with `__slots__` (the simulator touches them millions of times).
"""

from __future__ import annotations

import heapq
import math

from jaxrl.scheduler import cost


class WaitQueue:
  """Waiting requests: resumed ones first (oldest first), then new ones in id order or, for
  the oracle ranker, by true length from either end (two heaps, lazy deletion)."""

  def __init__(self, oracle: bool):
    self.oracle, self.resumed, self.new, self.seq = oracle, [], 0, 0
    self.long: list[tuple[int, int]] = []  # (-length, id), oracle only
    self.short: list[tuple[int, int]] = []  # (length or id, id)
    self.gone: set[int] = set()  # popped from one of the two heaps

  def __len__(self) -> int:
    return len(self.resumed) + self.new

  def push_new(self, rid: int, length: int):
    self.new += 1
    heapq.heappush(self.short, (length if self.oracle else rid, rid))
    if self.oracle:
      heapq.heappush(self.long, (-length, rid))

  def push_resumed(self, rid: int):
    self.seq += 1
    heapq.heappush(self.resumed, (self.seq, rid))

  def pop(self, longest: bool) -> int:
    if self.resumed:
      return heapq.heappop(self.resumed)[1]
    self.new -= 1
    if not self.oracle:
      return heapq.heappop(self.short)[1]
    heap = self.long if longest else self.short
    while True:
      rid = heapq.heappop(heap)[1]
      if rid in self.gone:
        self.gone.remove(rid)
      else:
        self.gone.add(rid)
        return rid


class SimRequest:
  __slots__ = ("group", "length", "gen", "admit", "history", "trained", "done")

  def __init__(self, group: int, length: int):
    self.group, self.length = group, length
    self.gen = 0  # tokens generated before the current admission
    self.admit = 0  # the instance clock at admission
    self.history: list[list[int]] = []  # [version, tokens], oldest first
    self.trained = 0
    self.done = 0


class SimInstance:
  __slots__ = (
    "uid", "pool", "acc", "tensor", "batch", "sync_s", "lane", "step", "version", "clock",
    "heap", "running", "ctx", "ctx2", "prefill", "state", "since", "seg", "phases", "epoch",
    "vclock", "vversion", "doomed", "starting", "born", "died", "busy", "longest",
  )  # fmt: skip

  def __init__(self, uid, model, pool, acc, tensor, batch, sync_s, lane, step, now, version):
    self.uid, self.pool, self.acc, self.tensor, self.batch = uid, pool, acc, tensor, batch
    self.sync_s, self.lane, self.step, self.version = sync_s, lane, step, version
    self.longest = False  # oracle ranker: takes the longest waiting requests
    self.clock = 0  # decode steps run so far
    self.heap: list[tuple[int, int]] = []  # (finish clock, request id)
    self.running: dict[int, SimRequest] = {}
    # Over running requests, c = prompt + gen - admit (context = c + clock): sums of c and c^2.
    self.ctx = self.ctx2 = 0
    # prefill_seconds is linear (weights) plus quadratic (attention) in one sequence's tokens;
    # a batch of sequences costs the sum: a * sum(t) + b * sum(t^2).
    f1, f2 = (cost.prefill_seconds(model, acc, tensor, t) for t in (1, 2))
    self.prefill = (2 * f1 - f2 / 2, f2 / 2 - f1)
    self.state, self.since = "idle", now
    self.seg = (0.0, 0, 0, 0.0)  # decoding: start time, start clock, steps, seconds per step
    self.phases: list[tuple[float, float, str]] = []  # busy: (start, end, kind)
    self.epoch = 0
    self.vclock, self.vversion = [0], [version]  # weight version from each clock on
    self.doomed = self.starting = False
    self.born, self.died, self.busy = now, math.inf, 0.0
