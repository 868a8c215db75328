"""Expert placements for expert parallelism: which device slots hold which experts, per layer
(the planners that make them are in `balance.py`).

Letters: l layers, x experts, d devices, s slots of a device, r replicas of an expert.

With `X` experts over `D` devices (`D` divides `X`), each device holds the weights of
`X // D + redundant_slots` experts. The home (static) placement puts expert `x` in slot
`x % (X // D)` of device `x // (X // D)`, its home device, and leaves the redundant slots empty.
A planner reads per-expert token counts and fills redundant slots with replicas of hot experts
(and, for `replicate_pack`, may also move experts off their home device) so that every device
gets about the same number of tokens. Planning is host-side numpy, once per rebalancing step.

A placement names its slots by a flat index `device * slots_per_device + slot`. Each expert has
one to `max_replicas` replicas, on distinct devices; replica 0 is its home replica: the one on
its home device when it has one there, else (an expert `replicate_pack` moved away) the one it
was packed onto first. Moved slots count the expert weights that must be copied to go from the
previous placement (or the home placement) to this one: slots that hold an expert they did not
hold before. Slots that are emptied cost nothing.
"""

import dataclasses
import json
import numbers
from typing import Any

import numpy as np

EMPTY = -1
"""The expert id of an empty slot and the slot index of a padding replica."""

_SHARE_ATOL = 1e-5  # float32 shares of up to a few hundred replicas sum to 1 within this.


def check_int(what: str, value: object, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{what} must be an int, got {value!r} ({type(value).__name__}).")
  if value < minimum:
    raise ValueError(f"{what} must be >= {minimum}, got {value}.")
  return int(value)


def _int_array(name: str, value: Any, ndim: int, dtype: type) -> np.ndarray:
  arr = np.asarray(value)
  if arr.ndim != ndim:
    raise ValueError(f"Placement.{name} must have {ndim} dimensions, got shape {arr.shape}.")
  if arr.size and arr.dtype.kind not in "iu":
    raise ValueError(f"Placement.{name} must hold integers, got dtype {arr.dtype}.")
  info = np.iinfo(dtype)
  if arr.size and (arr.min() < info.min or arr.max() > info.max):
    raise ValueError(f"Placement.{name} holds values beyond {np.dtype(dtype).name}.")
  out = arr.astype(dtype)
  out.flags.writeable = False
  return out


def _float_array(name: str, value: Any, ndim: int, dtype: type) -> np.ndarray:
  arr = np.asarray(value)
  if arr.ndim != ndim:
    raise ValueError(f"Placement.{name} must have {ndim} dimensions, got shape {arr.shape}.")
  if arr.size and arr.dtype.kind not in "iuf":
    raise ValueError(f"Placement.{name} must hold numbers, got dtype {arr.dtype}.")
  out = arr.astype(dtype)
  if not np.all(np.isfinite(out)):
    raise ValueError(f"Placement.{name} must be finite, got {out[~np.isfinite(out)][:4]}.")
  out.flags.writeable = False
  return out


def _first(mask: np.ndarray) -> tuple[int, ...]:
  return tuple(int(i) for i in np.argwhere(mask)[0])


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Placement:
  """Per layer: which expert each device slot holds and how each expert's tokens split.

  Checked on construction (the expert-parallel layer trusts it): consistent shapes, every
  expert has a replica 0 (its home replica, on its home device whenever it has a replica
  there), replicas of an expert sit on distinct devices and in slots that hold that expert,
  every non-empty slot is referenced by exactly one (expert, replica), shares are >= 0, 0 on
  padding and sum to 1. Arrays are converted to the dtypes below and made read-only. Equality
  is identity (the fields are arrays); compare `to_dict()` results to compare contents.

  Attributes:
    slot_expert_lds: int32 [layers, devices, slots_per_device], the expert id held in each
      slot, -1 for an empty slot.
    replica_slot_lxr: int32 [layers, experts, max_replicas], the flat slot index
      (`device * slots_per_device + slot`) of each replica of expert x, -1 padding after the
      last replica; replica 0 is the home replica.
    replica_share_lxr: float32 [layers, experts, max_replicas], the fraction of expert x's
      tokens sent to each replica; sums to 1 over r (an expert without load: [1, 0, ...]), 0 on
      padding.
    imbalance_l: float64 [layers], max device load / mean device load that this placement gives
      on the loads it was planned from (1.0 when all loads are zero).
    moved_slots_l: int64 [layers], slots whose expert differs from the previous placement (or
      the home placement), i.e. expert weights that must be copied; emptied slots not counted.
    method: the planner that made it, one of `METHODS` for placements made here.
  """

  slot_expert_lds: np.ndarray
  replica_slot_lxr: np.ndarray
  replica_share_lxr: np.ndarray
  imbalance_l: np.ndarray
  moved_slots_l: np.ndarray
  method: str

  def __post_init__(self):
    slot_expert_lds = _int_array("slot_expert_lds", self.slot_expert_lds, 3, np.int32)
    replica_slot_lxr = _int_array("replica_slot_lxr", self.replica_slot_lxr, 3, np.int32)
    share_lxr = _float_array("replica_share_lxr", self.replica_share_lxr, 3, np.float32)
    imbalance_l = _float_array("imbalance_l", self.imbalance_l, 1, np.float64)
    moved_slots_l = _int_array("moved_slots_l", self.moved_slots_l, 1, np.int64)
    for name, value in (
      ("slot_expert_lds", slot_expert_lds),
      ("replica_slot_lxr", replica_slot_lxr),
      ("replica_share_lxr", share_lxr),
      ("imbalance_l", imbalance_l),
      ("moved_slots_l", moved_slots_l),
    ):
      object.__setattr__(self, name, value)
    if not isinstance(self.method, str):
      raise ValueError(f"Placement.method must be a str, got {self.method!r}.")
    _validate(self)

  def __repr__(self) -> str:
    return (
      f"Placement(method={self.method!r}, layers={self.num_layers}, "
      f"experts={self.num_experts}, devices={self.num_devices}, "
      f"slots_per_device={self.slots_per_device}, max_replicas={self.max_replicas}, "
      f"imbalance_l={np.round(self.imbalance_l, 4).tolist()}, "
      f"moved_slots_l={self.moved_slots_l.tolist()})"
    )

  @property
  def num_layers(self) -> int:
    return self.slot_expert_lds.shape[0]

  @property
  def num_devices(self) -> int:
    return self.slot_expert_lds.shape[1]

  @property
  def slots_per_device(self) -> int:
    return self.slot_expert_lds.shape[2]

  @property
  def num_experts(self) -> int:
    return self.replica_slot_lxr.shape[1]

  @property
  def redundant_slots(self) -> int:
    """Slots per device beyond the `num_experts // num_devices` home slots."""
    return self.slots_per_device - self.num_experts // self.num_devices

  @property
  def max_replicas(self) -> int:
    return self.replica_slot_lxr.shape[2]

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dict of plain lists that `from_dict` turns back into this placement."""
    return {
      "method": self.method,
      "slot_expert_lds": self.slot_expert_lds.tolist(),
      "replica_slot_lxr": self.replica_slot_lxr.tolist(),
      "replica_share_lxr": self.replica_share_lxr.tolist(),
      "imbalance_l": self.imbalance_l.tolist(),
      "moved_slots_l": self.moved_slots_l.tolist(),
    }

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "Placement":
    """The placement `to_dict` wrote (validated again)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    missing = [name for name in fields if name not in data]
    unknown = [name for name in data if name not in fields]
    if missing or unknown:
      raise ValueError(
        f"A placement dict needs exactly the keys {fields}; missing {missing}, unknown {unknown}."
      )
    return cls(**{name: data[name] for name in fields})

  def to_json(self) -> str:
    return json.dumps(self.to_dict())

  @classmethod
  def from_json(cls, text: str) -> "Placement":
    return cls.from_dict(json.loads(text))


def _validate(p: Placement) -> None:
  slot_expert_lds, slot_lxr, share_lxr = p.slot_expert_lds, p.replica_slot_lxr, p.replica_share_lxr
  num_layers, num_devices, slots = slot_expert_lds.shape
  if min(num_layers, num_devices, slots) < 1:
    raise ValueError(
      f"Placement.slot_expert_lds must not be empty, got shape {slot_expert_lds.shape}."
    )
  if slot_lxr.shape != share_lxr.shape:
    raise ValueError(
      f"Placement.replica_slot_lxr {slot_lxr.shape} and replica_share_lxr {share_lxr.shape} "
      "must have the same shape [layers, experts, max_replicas]."
    )
  _, num_experts, max_replicas = slot_lxr.shape
  if slot_lxr.shape[0] != num_layers or num_experts < 1 or max_replicas < 1:
    raise ValueError(
      f"Placement.replica_slot_lxr must be [layers={num_layers}, experts>=1, max_replicas>=1], "
      f"got {slot_lxr.shape}."
    )
  for name, arr in (("imbalance_l", p.imbalance_l), ("moved_slots_l", p.moved_slots_l)):
    if arr.shape != (num_layers,):
      raise ValueError(f"Placement.{name} must be [layers={num_layers}], got {arr.shape}.")
  if num_experts % num_devices:
    raise ValueError(
      f"Placement has {num_experts} experts over {num_devices} devices: an expert axis that "
      "does not divide the experts."
    )
  home_slots = num_experts // num_devices
  if slots < home_slots:
    raise ValueError(
      f"Placement has {slots} slots per device but the {num_experts} experts need at least "
      f"{home_slots} per device over {num_devices} devices."
    )
  num_slots = num_devices * slots
  bad = (slot_expert_lds < EMPTY) | (slot_expert_lds >= num_experts)
  if bad.any():
    raise ValueError(
      f"Placement.slot_expert_lds[{_first(bad)}] = {slot_expert_lds[bad][0]} is not an expert id "
      f"in [0, {num_experts}) or -1 (empty)."
    )
  bad = (slot_lxr < EMPTY) | (slot_lxr >= num_slots)
  if bad.any():
    raise ValueError(
      f"Placement.replica_slot_lxr[{_first(bad)}] = {slot_lxr[bad][0]} needs a slot that does "
      f"not exist: there are {num_devices} devices x {slots} slots = {num_slots} slots "
      "(or -1 for padding)."
    )
  valid = slot_lxr >= 0
  if not valid[:, :, 0].all():
    (layer, expert) = _first(~valid[:, :, 0])
    raise ValueError(
      f"Expert {expert} of layer {layer} has no home replica: replica_slot_lxr[{layer}, "
      f"{expert}, 0] is -1; every expert needs replica 0."
    )
  gap = valid[:, :, 1:] & ~valid[:, :, :-1]
  if gap.any():
    raise ValueError(
      f"Placement.replica_slot_lxr[{_first(gap)}] follows padding: replicas must come first, "
      "then -1 padding."
    )
  if (share_lxr < 0).any() or (share_lxr[~valid] != 0).any():
    raise ValueError("Placement.replica_share_lxr must be >= 0, and 0 on padding replicas.")
  error = np.abs(share_lxr.astype(np.float64).sum(-1) - 1)
  if (error > _SHARE_ATOL).any():
    (layer, expert) = _first(error > _SHARE_ATOL)
    raise ValueError(
      f"The shares of expert {expert} of layer {layer} sum to "
      f"{share_lxr[layer, expert].sum()}, not 1: {share_lxr[layer, expert].tolist()}."
    )
  layer_lxr = np.broadcast_to(np.arange(num_layers)[:, None, None], slot_lxr.shape)
  expert_lxr = np.broadcast_to(np.arange(num_experts)[None, :, None], slot_lxr.shape)
  held = slot_expert_lds.reshape(num_layers, num_slots)[layer_lxr[valid], slot_lxr[valid]]
  wrong = held != expert_lxr[valid]
  if wrong.any():
    i = int(np.argmax(wrong))
    raise ValueError(
      f"Replica of expert {expert_lxr[valid][i]} in layer {layer_lxr[valid][i]} points at slot "
      f"{slot_lxr[valid][i]}, which holds expert {held[i]}."
    )
  refs_ls = np.bincount(
    layer_lxr[valid] * num_slots + slot_lxr[valid], minlength=num_layers * num_slots
  ).reshape(num_layers, num_slots)
  held_ls = slot_expert_lds.reshape(num_layers, num_slots) != EMPTY
  bad = refs_ls != held_ls
  if bad.any():
    layer, slot = _first(bad)
    raise ValueError(
      f"Slot {slot} of layer {layer} (expert {slot_expert_lds.reshape(num_layers, -1)[layer, slot]}"
      f") is referenced by {refs_ls[layer, slot]} replicas; a non-empty slot needs exactly one, "
      "an empty slot none."
    )
  device_lxr = np.where(valid, slot_lxr // slots, EMPTY)
  keys = (layer_lxr * num_experts + expert_lxr)[valid] * num_devices + device_lxr[valid]
  if np.unique(keys).size != keys.size:
    raise ValueError("An expert has two replicas on one device; replicas need distinct devices.")
  home_lx = np.arange(num_experts)[None, :] // home_slots
  on_home_lxr = device_lxr == home_lx[:, :, None]
  misplaced = on_home_lxr.any(-1) & ~on_home_lxr[:, :, 0]
  if misplaced.any():
    layer, expert = _first(misplaced)
    raise ValueError(
      f"Expert {expert} of layer {layer} has a replica on its home device {expert // home_slots}"
      " that is not replica 0; the replica on the home device must be replica 0."
    )
  if (p.imbalance_l < 1 - 1e-9).any():
    raise ValueError(f"Placement.imbalance_l must be >= 1 (max / mean), got {p.imbalance_l}.")
  if ((p.moved_slots_l < 0) | (p.moved_slots_l > num_slots)).any():
    raise ValueError(
      f"Placement.moved_slots_l must be in [0, {num_slots}] (the slots per layer), got "
      f"{p.moved_slots_l}."
    )


def check_loads(loads: Any) -> np.ndarray:
  loads_lx = np.asarray(loads)
  if loads_lx.dtype.kind not in "iuf":
    raise ValueError(f"loads must be numbers (token counts), got dtype {loads_lx.dtype}.")
  loads_lx = loads_lx.astype(np.float64)
  if loads_lx.ndim != 2 or 0 in loads_lx.shape:
    raise ValueError(
      f"loads must be [layers, experts] token counts, got shape {loads_lx.shape}; for one layer "
      "pass loads[None]."
    )
  if not np.all(np.isfinite(loads_lx)):
    raise ValueError("loads must be finite; it holds NaN or inf (a broken routing count?).")
  if (loads_lx < 0).any():
    raise ValueError(f"loads must be >= 0 (token counts), got minimum {loads_lx.min()}.")
  return loads_lx


def imbalance(device_loads_ld: Any) -> np.ndarray:
  """Max device load / mean device load over the last axis; 1.0 where all loads are zero.

  Args:
    device_loads_ld: [..., devices] non-negative loads, e.g. from `device_loads`.

  Returns:
    float64 [...], each >= 1.
  """
  loads = np.asarray(device_loads_ld, np.float64)
  mean = loads.mean(-1)
  return np.where(mean > 0, loads.max(-1) / np.where(mean > 0, mean, 1), 1.0)


def device_loads(placement: Placement, loads: Any) -> np.ndarray:
  """The tokens each device receives when `placement` splits `loads` over expert replicas.

  Shares are renormalised in float64 per expert, so float32 rounding of the shares neither
  creates nor loses tokens: the device loads of a layer add up to its total load.

  Args:
    placement: the placement.
    loads: [layers, experts] token counts per expert.

  Returns:
    float64 [layers, devices].
  """
  loads_lx = check_loads(loads)
  num_layers, num_experts = placement.num_layers, placement.num_experts
  if loads_lx.shape != (num_layers, num_experts):
    raise ValueError(
      f"loads has shape {loads_lx.shape} but the placement is for {num_layers} layers x "
      f"{num_experts} experts."
    )
  return loads_per_device(
    loads_lx,
    placement.replica_slot_lxr,
    placement.replica_share_lxr,
    placement.num_devices,
    placement.slots_per_device,
  )


def bytes_moved(placement: Placement, bytes_per_expert: int) -> int:
  """Bytes of expert weights copied to reach `placement`, over all its layers.

  Args:
    placement: the placement.
    bytes_per_expert: the size of one expert's weights in one layer (e.g. gate, up and down
      projections: 3 * embed * mlp * bytes per parameter).

  Returns:
    `sum(placement.moved_slots_l) * bytes_per_expert`.
  """
  bytes_per_expert = check_int("bytes_per_expert", bytes_per_expert, 0)
  return int(placement.moved_slots_l.sum()) * bytes_per_expert


def _home_replica_slot_x(num_experts: int, num_devices: int, redundant_slots: int) -> np.ndarray:
  home_slots = num_experts // num_devices
  expert_x = np.arange(num_experts)
  return (expert_x // home_slots) * (home_slots + redundant_slots) + expert_x % home_slots


def check_divides(num_experts: int, num_devices: int) -> None:
  if num_experts % num_devices:
    divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    raise ValueError(
      f"num_devices={num_devices} is an expert axis that does not divide the experts "
      f"({num_experts}); use a number of devices that divides them: {divisors}."
    )


class LayerPlan:
  """One layer's placement while it is planned, with room for one replica per device."""

  def __init__(self, num_experts: int, num_devices: int, slots: int):
    self.slot_expert_ds = np.full((num_devices, slots), EMPTY, np.int32)
    self.slot_xr = np.full((num_experts, num_devices), EMPTY, np.int32)
    self.share_xr = np.zeros((num_experts, num_devices), np.float32)


def home_layer(num_experts: int, num_devices: int, slots: int) -> LayerPlan:
  home_slots = num_experts // num_devices
  layer = LayerPlan(num_experts, num_devices, slots)
  layer.slot_expert_ds[:, :home_slots] = np.arange(num_experts).reshape(num_devices, home_slots)
  layer.slot_xr[:, 0] = _home_replica_slot_x(num_experts, num_devices, slots - home_slots)
  layer.share_xr[:, 0] = 1
  return layer


def home_placement(
  num_layers: int, num_experts: int, num_devices: int, redundant_slots: int
) -> Placement:
  """The static placement: expert x in slot x % (X // D) of device x // (X // D), no replicas.

  Args:
    num_layers: MoE layers, >= 1.
    num_experts: experts per layer (X), divisible by `num_devices`.
    num_devices: devices on the expert axis (D).
    redundant_slots: empty slots per device beyond the X // D home slots, >= 0.

  Returns:
    A placement with method "static", imbalance 1.0 (no loads given) and no moved slots.
  """
  num_layers = check_int("num_layers", num_layers, 1)
  num_experts = check_int("num_experts", num_experts, 1)
  num_devices = check_int("num_devices", num_devices, 1)
  redundant_slots = check_int("redundant_slots", redundant_slots, 0)
  check_divides(num_experts, num_devices)
  layer = home_layer(num_experts, num_devices, num_experts // num_devices + redundant_slots)
  return Placement(
    slot_expert_lds=np.broadcast_to(
      layer.slot_expert_ds, (num_layers, *layer.slot_expert_ds.shape)
    ),
    replica_slot_lxr=np.broadcast_to(layer.slot_xr[:, :1], (num_layers, num_experts, 1)),
    replica_share_lxr=np.broadcast_to(layer.share_xr[:, :1], (num_layers, num_experts, 1)),
    imbalance_l=np.ones(num_layers),
    moved_slots_l=np.zeros(num_layers, np.int64),
    method="static",
  )


def loads_per_device(
  loads_lx: np.ndarray,
  replica_slot_lxr: np.ndarray,
  replica_share_lxr: np.ndarray,
  num_devices: int,
  slots: int,
) -> np.ndarray:
  num_layers = loads_lx.shape[0]
  share_lxr = replica_share_lxr.astype(np.float64)
  share_lxr /= share_lxr.sum(-1, keepdims=True)
  valid = replica_slot_lxr >= 0
  layer_lxr = np.broadcast_to(np.arange(num_layers)[:, None, None], valid.shape)
  device_lxr = replica_slot_lxr // slots
  return np.bincount(
    (layer_lxr * num_devices + device_lxr)[valid],
    weights=(loads_lx[:, :, None] * share_lxr)[valid],
    minlength=num_layers * num_devices,
  ).reshape(num_layers, num_devices)
