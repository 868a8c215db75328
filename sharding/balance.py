"""Planners of expert placements from per-expert token counts (`plan_placement`, `METHODS`).

Letters: l layers, x experts, d devices, s slots of a device, r replicas of an expert.

`static` keeps the home placement; `replicate_pack` (EPLB style) gives the hottest experts
replicas in the redundant slots and packs all replicas onto devices by load; `least_loaded`
(LLEP / UltraEP style) keeps every expert home and spills the exact excess tokens of overloaded
devices onto replicas on the least loaded ones. What a placement is: `placement.py`.
"""

import collections
import heapq
import numbers
from typing import Any

import numpy as np

from jaxrl.sharding.placement import (
  EMPTY,
  LayerPlan,
  Placement,
  check_divides,
  check_int,
  check_loads,
  home_layer,
  home_placement,
  imbalance,
  loads_per_device,
)

METHODS = ("static", "replicate_pack", "least_loaded")
"""The planners of `plan_placement`, by name."""


class _Spill:
  """least_loaded's state: the tokens each expert has on each device, device loads, free slots."""

  def __init__(self, load_x: np.ndarray, num_devices: int, redundant_slots: int, tol: float):
    self.home_slots = load_x.size // num_devices
    self.target = float(load_x.sum()) / num_devices
    self.limit = self.target * (1 + tol)
    self.eps = self.target * 1e-9
    self.load_d = load_x.reshape(num_devices, self.home_slots).sum(1)
    self.free_d = np.full(num_devices, redundant_slots)
    # The same numbers indexed both ways; an expert's home device comes first in tokens_xd.
    self.tokens_xd = [{x // self.home_slots: float(t)} for x, t in enumerate(load_x)]
    self.tokens_dx = [{} for _ in range(num_devices)]
    for x, t in enumerate(load_x):
      self.tokens_dx[x // self.home_slots][x] = float(t)

  def move(self, expert: int, source: int, dest: int, amount: float) -> None:
    if dest not in self.tokens_xd[expert]:
      self.free_d[dest] -= 1
      self.tokens_xd[expert][dest] = self.tokens_dx[dest][expert] = 0.0
    for d, t in ((source, -amount), (dest, amount)):
      self.tokens_xd[expert][d] += t
      self.tokens_dx[d][expert] += t
      self.load_d[d] += t

  def overloaded(self) -> int | None:
    """The most loaded device if it is above the limit."""
    source = int(np.argmax(self.load_d))
    return source if self.load_d[source] > self.limit else None

  def spill(self) -> None:
    """Moves the excess of the most loaded device to receivers, one expert at a time."""
    while (source := self.overloaded()) is not None:
      room_d = self.target - self.load_d
      open_d = np.where((self.free_d > 0) & (room_d > self.eps), self.load_d, np.inf)
      new_dest = int(np.argmin(open_d)) if np.isfinite(open_d.min()) else None
      dest = None
      # Until augment() runs, only home replicas sit on a device above the target: a receiver
      # is filled up to the target and no further.
      on_source = self.tokens_dx[source]
      for x in sorted(on_source, key=on_source.__getitem__, reverse=True):
        if on_source[x] <= self.eps:
          break
        reuse = [d for d in self.tokens_xd[x] if room_d[d] > self.eps]
        dest = min(reuse, key=self.load_d.__getitem__) if reuse else new_dest
        if dest is not None:
          break
      if dest is None:
        return  # The most loaded device cannot shed load to a receiver.
      excess = self.load_d[source] - self.target
      self.move(x, source, dest, min(excess, on_source[x], room_d[dest]))

  def augment(self) -> None:
    """Moves load from the most loaded device along a chain of replicas to a device with room.

    Tokens shift between replicas of the same expert at no cost in slots, so a chain
    `source -> a -> ... -> receiver` (each hop an expert with tokens on one device and a replica
    on the next) unloads the source without touching the devices in between. A chain may add
    replicas in free slots where no chain of existing ones reaches a receiver.
    """
    # Each chain empties a source's excess, a receiver's room or a hop; a hop can fill up again,
    # so the number of chains is capped rather than argued finite.
    for _ in range(4 * (len(self.tokens_xd) + self.load_d.size)):
      source = self.overloaded()
      if source is None:
        return
      chain = self._chain(source, new_replicas=False) or self._chain(source, new_replicas=True)
      if chain is None:
        return
      receiver = chain[-1][2]
      amount = min(self.load_d[source] - self.target, self.target - self.load_d[receiver])
      amount = min([amount] + [self.tokens_dx[u][x] for x, u, _ in chain])
      if amount <= self.eps:
        return
      for x, u, v in chain:
        self.move(x, u, v, amount)

  def _chain(self, source: int, new_replicas: bool) -> list[tuple[int, int, int]] | None:
    """The shortest chain of (expert, from device, to device) hops to a device below target."""
    parent = {source: None}
    queue = collections.deque([source])
    free = np.flatnonzero(self.free_d > 0).tolist() if new_replicas else []
    while queue:
      u = queue.popleft()
      hops = [
        (x, v) for x, t in self.tokens_dx[u].items() if t > self.eps for v in self.tokens_xd[x]
      ]
      if free and self.tokens_dx[u]:
        x = max(self.tokens_dx[u], key=self.tokens_dx[u].__getitem__)
        hops += [(x, v) for v in free if v not in self.tokens_xd[x]]
      for x, v in hops:
        if v in parent or self.tokens_dx[u][x] <= self.eps:
          continue
        parent[v] = (x, u)
        if self.load_d[v] < self.target - self.eps:
          chain = []
          while parent[v] is not None:
            x, u = parent[v]
            chain.append((x, u, v))
            v = u
          return chain[::-1]
        queue.append(v)
    return None

  def replicas(self, expert: int) -> list[tuple[int, float]]:
    """(device, share) of the expert's replicas, home first, without the emptied ones."""
    items = list(self.tokens_xd[expert].items())
    kept = items[:1] + [(d, t) for d, t in items[1:] if t > self.eps]
    total = sum(t for _, t in kept)
    return [(d, t / total if total > 0 else float(d == kept[0][0])) for d, t in kept]


def _least_loaded_layer(
  load_x: np.ndarray, num_devices: int, slots: int, ref_ds: np.ndarray, tol: float
) -> LayerPlan:
  """Home placement, then spills the exact excess of overloaded devices to redundant slots."""
  num_experts = load_x.size
  home_slots = num_experts // num_devices
  layer = home_layer(num_experts, num_devices, slots)
  if load_x.sum() == 0 or slots == home_slots:
    return layer
  state = _Spill(load_x, num_devices, slots - home_slots, tol)
  state.spill()
  state.augment()
  for x in range(num_experts):
    replicas = state.replicas(x)
    layer.share_xr[x, 0] = replicas[0][1]
    for r, (d, share) in enumerate(replicas[1:], start=1):
      s = _free_slot(layer.slot_expert_ds[d], ref_ds[d], x, home_slots)
      layer.slot_expert_ds[d, s] = x
      layer.slot_xr[x, r] = d * slots + s
      layer.share_xr[x, r] = share
  return layer


def _free_slot(slot_expert_s: np.ndarray, ref_s: np.ndarray, expert: int, start: int) -> int:
  """An empty slot at or after `start`: the one `expert` had in the reference if it is free."""
  empty = np.flatnonzero(slot_expert_s[start:] == EMPTY) + start
  kept = empty[ref_s[empty] == expert]
  return int(kept[0] if kept.size else empty[0])


def _replica_counts(load_x: np.ndarray, num_devices: int, extra: int) -> np.ndarray:
  """EPLB's replica counts: each extra replica to the expert with the largest load per replica.

  Giving them out one at a time picks, in order, the largest of `load_x / k` (the load per
  replica an expert with k replicas has, so what its next replica relieves); taking the top
  `extra` of those at once gives the same counts. At most one replica per device and none for
  an expert without load.
  """
  count_x = np.ones(load_x.size, np.int64)
  if extra and num_devices > 1:
    gain = (load_x[:, None] / np.arange(1, num_devices)[None, :]).ravel()
    n = min(extra, int(np.count_nonzero(gain)))
    if n:
      top = np.argpartition(-gain, n - 1)[:n]
      count_x += np.bincount(top // (num_devices - 1), minlength=load_x.size)
  return count_x


def _replicate_pack_layer(
  load_x: np.ndarray, num_devices: int, slots: int, ref_ds: np.ndarray, tol: float
) -> LayerPlan:
  """EPLB: replica counts by largest load per replica, then heaviest-first greedy packing."""
  del tol  # Uses every redundant slot that helps; there is no stopping tolerance.
  num_experts = load_x.size
  home_slots = num_experts // num_devices
  if slots == home_slots:
    # Without redundant slots there is nothing to replicate; a permutation of the experts
    # alone could balance somewhat, but would copy most of them for it.
    return home_layer(num_experts, num_devices, slots)
  count_x = _replica_counts(load_x, num_devices, num_devices * (slots - home_slots))
  per_replica_x = load_x / count_x

  # Where each expert sits in the reference placement: keeping it there costs no copy, so a
  # device it already had wins a tie, takes it when it carries no load, and keeps its slot.
  ref_slot = {}
  ref_devices_x = [[] for _ in range(num_experts)]
  for d, s in zip(*np.nonzero(ref_ds >= 0), strict=True):
    x = int(ref_ds[d, s])
    ref_slot[x, int(d)] = int(s)
    ref_devices_x[x].append(int(d))

  # A heap of (load, device, version) over devices with a free slot; an entry is stale once
  # its device's version has moved on.
  load_d = [0.0] * num_devices
  free_d = [slots] * num_devices
  version_d = [0] * num_devices
  heap = [(0.0, d, 0) for d in range(num_devices)]

  def pop() -> int | None:
    while heap:
      _, d, version = heapq.heappop(heap)
      if version == version_d[d]:
        return d
    return None

  def put(d: int, load: float) -> None:
    load_d[d] += load
    free_d[d] -= 1
    version_d[d] += 1
    if free_d[d]:
      heapq.heappush(heap, (load_d[d], d, version_d[d]))

  devices_x = [None] * num_experts
  for x in np.argsort(-per_replica_x, kind="stable").tolist():
    load = float(per_replica_x[x])
    chosen = []
    for _ in range(int(count_x[x])):
      d = pop()
      if d is None:
        break  # Fewer devices with a free slot than replicas: the expert gets fewer.
      chosen.append(d)
    if len(chosen) == 1:
      d = chosen[0]
      for ref in ref_devices_x[x]:
        if ref != d and free_d[ref] and (load == 0 or load_d[ref] == load_d[d]):
          heapq.heappush(heap, (load_d[d], d, version_d[d]))
          chosen = [ref]
          break
    load = float(load_x[x]) / len(chosen)
    for d in chosen:
      put(d, load)
    devices_x[x] = chosen
  if imbalance(load_d) >= imbalance(load_x.reshape(num_devices, home_slots).sum(1)):
    return home_layer(num_experts, num_devices, slots)  # Greedy packing can lose to home.

  layer = LayerPlan(num_experts, num_devices, slots)
  pending = []
  for x, chosen in enumerate(devices_x):
    home = x // home_slots
    if home in chosen:
      chosen.remove(home)
      chosen.insert(0, home)
    layer.share_xr[x, : len(chosen)] = 1 / len(chosen)
    for r, d in enumerate(chosen):
      s = ref_slot.get((x, d))
      if s is None:
        pending.append((x, r, d))
      else:
        layer.slot_expert_ds[d, s] = x
        layer.slot_xr[x, r] = d * slots + s
  for x, r, d in pending:
    s = int(np.argmax(layer.slot_expert_ds[d] == EMPTY))
    layer.slot_expert_ds[d, s] = x
    layer.slot_xr[x, r] = d * slots + s
  return layer


_PLANNERS = {"replicate_pack": _replicate_pack_layer, "least_loaded": _least_loaded_layer}


def _check_previous(
  previous: Any, num_layers: int, num_experts: int, num_devices: int, slots: int
) -> None:
  if not isinstance(previous, Placement):
    raise ValueError(
      f"previous must be a Placement (the plan now in use) or None, got {type(previous).__name__}."
    )
  want = (num_layers, num_experts, num_devices, slots)
  have = (
    previous.num_layers,
    previous.num_experts,
    previous.num_devices,
    previous.slots_per_device,
  )
  if have != want:
    raise ValueError(
      f"previous is for (layers, experts, devices, slots_per_device) = {have} but this plan is for "
      f"{want}: its slots do not fit this plan. Plan with the same layers, experts, devices and "
      f"redundant_slots={previous.redundant_slots} as previous, or pass previous=None."
    )


def plan_placement(
  loads: Any,
  num_devices: int,
  redundant_slots: int,
  method: str,
  *,
  previous: Placement | None = None,
  tol: float = 0.01,
) -> Placement:
  """Plans which device slots hold which experts so that devices get even token loads.

  Methods (`METHODS`):
    static: the home placement, no balancing.
    replicate_pack: EPLB. Per layer, gives the `num_devices * redundant_slots` extra replicas
      one at a time to the expert with the largest load per replica (at most one replica per
      device, none to experts without load), then packs experts heaviest replica first onto the
      least-loaded devices with a free slot, each replica carrying an equal share. Experts may
      leave their home device (most do: it is a fresh packing); ties, and experts without load,
      go to a device (and slot) the expert already had. Falls back to the home placement where
      the packing is not better, and with `redundant_slots=0`.
    least_loaded: LLEP with slots. Keeps every expert on its home slot; while the most loaded
      device is above `(1 + tol)` times the mean, moves min(its excess, the tokens of its
      heaviest expert, the receiver's room below the mean) to a replica of that expert: an
      existing one on a device with room, else a new one on the least-loaded device with a free
      slot. Shares are the exact token fractions. Where that stops above `1 + tol` (a receiver
      takes one expert per free slot, so one slot per device can run out before the room
      does), load moves along chains of replicas instead: from the most loaded device to one
      holding a replica of its expert, which passes as many tokens of its own experts on,
      and so on to a device below the mean; a chain adds a replica in a free slot only where
      no chain of existing replicas reaches one. Never worse than static.

  Args:
    loads: [layers, experts] non-negative token counts per expert (experts divisible by
      `num_devices`).
    num_devices: devices on the expert axis.
    redundant_slots: extra slots per device for replicas (>= 0); 0 gives the home placement
      for every method.
    method: one of `METHODS`.
    previous: the placement in use, with the same shape; moved slots are counted against it
      (else against the home placement) and replicas keep their slots in it where they can.
    tol: least_loaded stops once max / mean device load is at most `1 + tol`.

  Returns:
    The placement, with the imbalance it gives on `loads` and the slots it moves.

  Raises:
    ValueError: loads of the wrong rank, negative or not finite; experts not divisible by
      `num_devices`; `redundant_slots < 0`; an unknown method; a `previous` of another shape.
  """
  loads_lx = check_loads(loads)
  num_devices = check_int("num_devices", num_devices, 1)
  redundant_slots = check_int("redundant_slots", redundant_slots, 0)
  if method not in METHODS:
    raise ValueError(f"Unknown placement method {method!r}; choose one of {METHODS}.")
  if not isinstance(tol, numbers.Real) or not 0 <= tol < np.inf:
    raise ValueError(f"tol must be a finite number >= 0, got {tol!r}.")
  num_layers, num_experts = loads_lx.shape
  check_divides(num_experts, num_devices)
  slots = num_experts // num_devices + redundant_slots
  home = home_placement(num_layers, num_experts, num_devices, redundant_slots)
  if previous is not None:
    _check_previous(previous, num_layers, num_experts, num_devices, slots)
  ref_lds = home.slot_expert_lds if previous is None else previous.slot_expert_lds

  if method == "static":
    slot_expert_lds = home.slot_expert_lds
    replica_slot_lxr = home.replica_slot_lxr
    replica_share_lxr = home.replica_share_lxr
  else:
    plan = _PLANNERS[method]
    layers = [plan(loads_lx[i], num_devices, slots, ref_lds[i], tol) for i in range(num_layers)]
    max_replicas = max(int((layer.slot_xr >= 0).sum(1).max()) for layer in layers)
    slot_expert_lds = np.stack([layer.slot_expert_ds for layer in layers])
    replica_slot_lxr = np.stack([layer.slot_xr[:, :max_replicas] for layer in layers])
    replica_share_lxr = np.stack([layer.share_xr[:, :max_replicas] for layer in layers])
  loads_ld = loads_per_device(loads_lx, replica_slot_lxr, replica_share_lxr, num_devices, slots)
  moved_slots_l = ((slot_expert_lds != ref_lds) & (slot_expert_lds != EMPTY)).sum((1, 2))
  return Placement(
    slot_expert_lds=slot_expert_lds,
    replica_slot_lxr=replica_slot_lxr,
    replica_share_lxr=replica_share_lxr,
    imbalance_l=imbalance(loads_ld),
    moved_slots_l=moved_slots_l,
    method=method,
  )
