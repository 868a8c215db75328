"""Device meshes with the four named axes, and disjoint device groups for disaggregated stages.

Every mesh built here has all of `MESH_AXES`, in that order; an axis a stage does not use has
size 1. Devices are laid out in the order given (row-major over `MESH_AXES`), so the caller (a
plan) decides which devices are neighbours on the fastest-varying axes (`expert`, `tensor`).
"""

import math
import numbers
from collections.abc import Mapping, Sequence

import jax
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor", "expert")

_FILL = -1


def _format_sizes(sizes: Mapping[str, int]) -> str:
  return ", ".join(f"{name}={size}" for name, size in sizes.items())


def _check_int(what: str, value: object) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{what} must be an int, got {value!r} ({type(value).__name__}).")
  return int(value)


def _check_unique(devices: Sequence[jax.Device]) -> None:
  seen = set()
  for device in devices:
    if device in seen:
      raise ValueError(f"Device {device} is listed more than once; pass each device once.")
    seen.add(device)


def make_mesh(devices: Sequence[jax.Device], axes: Mapping[str, int]) -> jax.sharding.Mesh:
  """Builds a mesh over exactly `devices` with the axes `MESH_AXES`.

  Args:
    devices: the devices of the mesh, all of them used, laid out row-major over `MESH_AXES`.
    axes: size of each mesh axis by name, any subset of `MESH_AXES`; missing axes have size 1.
      At most one size may be -1, meaning "all the devices the other axes leave".

  Returns:
    A `jax.sharding.Mesh` with axis names `MESH_AXES` (in that order).

  Raises:
    ValueError: an unknown axis name, a size < 1 (other than one -1), more than one -1, a -1
      that does not divide evenly, or sizes whose product is not the number of devices.
  """
  devices = list(devices)
  if not devices:
    raise ValueError("make_mesh needs at least one device, got an empty device list.")
  _check_unique(devices)
  unknown = [name for name in axes if name not in MESH_AXES]
  if unknown:
    raise ValueError(
      f"Unknown mesh axis name(s) {unknown} in {dict(axes)}; the mesh axes are {MESH_AXES}."
    )
  sizes = {name: 1 for name in MESH_AXES}
  for name, size in axes.items():
    sizes[name] = _check_int(f"Mesh axis {name!r} size", size)

  fill = [name for name, size in sizes.items() if size == _FILL]
  if len(fill) > 1:
    raise ValueError(
      f"At most one mesh axis may be -1 (fill with the remaining devices), got {fill} in "
      f"{_format_sizes(sizes)}; give explicit sizes to all but one."
    )
  bad = [name for name, size in sizes.items() if size < 1 and size != _FILL]
  if bad:
    raise ValueError(
      f"Mesh axis sizes must be >= 1 (or -1 for one axis to fill), got "
      f"{_format_sizes({name: sizes[name] for name in bad})}."
    )

  n = len(devices)
  if fill:
    known = math.prod(size for size in sizes.values() if size != _FILL)
    if n % known:
      raise ValueError(
        f"Cannot fill mesh axis {fill[0]!r}: {n} devices are not divisible by the product "
        f"{known} of the other axis sizes ({_format_sizes(sizes)}); change the other sizes "
        f"to divide {n}, or use {n - n % known} devices."
      )
    sizes[fill[0]] = n // known

  total = math.prod(sizes.values())
  if total != n:
    raise ValueError(
      f"Mesh axis sizes {_format_sizes(sizes)} need {total} devices but {n} were given; change "
      f"the sizes so that their product is {n}, or set one axis to -1 to fill."
    )
  device_array = np.empty(n, dtype=object)
  device_array[:] = devices
  return jax.sharding.Mesh(device_array.reshape([sizes[name] for name in MESH_AXES]), MESH_AXES)


def split_devices(devices: Sequence[jax.Device], sizes: Sequence[int]) -> list[list[jax.Device]]:
  """Splits `devices` into disjoint groups of consecutive devices, one group per size.

  Devices beyond `sum(sizes)` are left out of every group.

  Args:
    devices: the devices to split, in order.
    sizes: the number of devices in each group, each >= 1.

  Returns:
    One list of devices per entry of `sizes`: `devices[0:sizes[0]]`, the next `sizes[1]`, ...

  Raises:
    ValueError: a size < 1, or sizes that add up to more than `len(devices)`.
  """
  devices = list(devices)
  _check_unique(devices)
  sizes = [_check_int("Device group size", size) for size in sizes]
  bad = [size for size in sizes if size < 1]
  if bad:
    raise ValueError(f"Device group sizes must be >= 1, got {sizes}.")
  if sum(sizes) > len(devices):
    raise ValueError(
      f"Device group sizes {sizes} add up to {sum(sizes)} but there are only {len(devices)} "
      f"devices; make the sizes add up to at most {len(devices)}."
    )
  groups = []
  start = 0
  for size in sizes:
    groups.append(devices[start : start + size])
    start += size
  return groups
