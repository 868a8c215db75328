"""Host arrays to and from a mesh that may span processes (a JAX world of several processes).

Within one process `jax.device_put` and `np.asarray` move arrays between the host and a mesh.
Across processes neither works as such: `device_put` of a host array first checks, with a
collective, that every process passes the same value, jit takes host arrays only for replicated
inputs, and no process can read an array whose shards live in other processes. The SPMD
programs that use these helpers hold the same host values on every process by construction, so:

- `to_devices`: each process places only the pieces its own devices hold, cut from its copy
  (`jax.make_array_from_callback`): no collective, no process sends another one anything.
- `readable`: outputs the host reads are laid out replicated over a mesh that spans processes
  (the program gathers them on the devices), and `host_array` reads the process's own replica.

Within one process all three are what they were (`device_put`, the sharding as given,
`np.asarray`), so a one-process mesh pays nothing for them.

Within one process, `move_between_devices` takes arrays onto other devices without the trip
through the host that `device_put` makes between layouts whose pieces differ, and
`readable_from_threads` readies arrays that several threads will read at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def to_devices(tree, shardings):
  """`tree` (host arrays, the same on every process, or arrays) onto `shardings` (a matching
  tree of shardings, or one sharding for every leaf)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _to_global(x, shardings), tree)
  return jax.tree.map(_to_global, tree, shardings)


def _to_global(x, sharding: jax.sharding.Sharding):
  if isinstance(x, jax.Array) or sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def readable_from_threads(tree):
  """`tree`, with each array's per-device pieces listed now, before threads share it.

  jaxlib lists a multi-device array's pieces (`addressable_shards`, which `device_put` to
  another layout reads) lazily, on first use, and not under a lock: two threads that read a
  fresh array at once can each append the pieces, and the array then holds twice as many
  pieces as devices for good (measured on jax 0.10.2's CPU client: 4 of 100 rounds of two
  threads moving the same 300 fresh arrays, against 0 of 150 with the pieces listed first;
  `device_put` then fails with `safe_zip() ... (8, 4)`). Listing them on one thread first
  leaves the threads only reads."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.addressable_shards  # noqa: B018 (the read lists the pieces)
  return tree


def readable(mesh: Mesh, sharding: NamedSharding) -> NamedSharding:
  """The layout of an output the host reads: `sharding` within one process, replicated over
  `mesh` when it spans processes (so that every process holds the whole array)."""
  return NamedSharding(mesh, PartitionSpec()) if mesh.is_multi_process else sharding


def host_array(x: jax.Array) -> np.ndarray:
  """The host value of `x`: fully addressable, or replicated (`readable`) over processes."""
  if x.is_fully_addressable:
    return np.asarray(x)
  if not x.sharding.is_fully_replicated:
    raise ValueError(
      f"An array of shape {x.shape} laid out as {x.sharding} spans processes and is not "
      "replicated; lay the output out with `readable` to read it on the host."
    )
  return np.asarray(x.addressable_data(0))


def move_between_devices(tree, shardings, *, joined_bytes_in_flight: int = 1 << 29):
  """Arrays on devices of this process onto `shardings` (a matching tree) over other devices,
  device to device. `device_put` alone reads an array whose pieces differ from its target's
  (a learner's fsdp pieces, an engine's tensor-parallel ones) whole onto the host. Here each
  array's pieces are copied to the first device of its target and joined there, then cut and
  copied to the target's devices; an array whose pieces match its target's, or that sits on
  one device, goes by `device_put` (device to device too). Every program runs on one device:
  no collective runs on the source devices, so a thread may take weights off devices another
  thread trains on (collectives from two threads on the same devices can deadlock, NCCL's
  rule). Memory: joined arrays wait on their first device until they are cut and copied; past
  `joined_bytes_in_flight` of them the call waits for those copies, so that no more than that
  (and one array) is held there at once, not the whole model's."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  # Arrays `device_put` moves device to device go in one batched call (a colocated engine's
  # every leaf, at every weight update); the others are joined one at a time.
  direct = [_direct(x, s) for x, s in zip(leaves, targets, strict=True)]
  at = [i for i, d in enumerate(direct) if d]
  out = list(leaves)
  placed = jax.device_put([leaves[i] for i in at], [targets[i] for i in at])
  for i, x in zip(at, placed, strict=True):
    out[i] = x
  joined = 0
  for i in (i for i, d in enumerate(direct) if not d):
    out[i] = _joined_and_cut(leaves[i], targets[i])
    joined += leaves[i].nbytes
    if joined > joined_bytes_in_flight:
      jax.block_until_ready(out[: i + 1])
      joined = 0
  return jax.tree.unflatten(treedef, out)


def _direct(x, sharding: jax.sharding.Sharding) -> bool:
  """Whether `device_put` moves `x` onto `sharding` without reading it whole onto the host: a
  host value, one device's array, the same devices (a reshard there), or the same pieces."""
  if not isinstance(x, jax.Array):
    return True
  src = x.sharding
  return src.num_devices == 1 or src.device_set == sharding.device_set or _same_pieces(x, sharding)


def _joined_and_cut(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """`x`'s pieces copied to `sharding`'s first device and joined, then cut onto `sharding`."""
  pieces = {}
  for shard in x.addressable_shards:
    where = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, x.shape, strict=True))
    pieces.setdefault(where, shard.data)
  first = min(sharding.device_set, key=lambda d: d.id)
  moved = jax.device_put(list(pieces.values()), first)
  whole = moved[0] if len(moved) == 1 else _join(moved, tuple(pieces), x.shape)
  return jax.device_put(whole, sharding)


def _same_pieces(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
  """Whether `sharding` cuts `x` into the pieces its own sharding does (on other devices)."""
  src = x.sharding
  try:
    hlo = src._to_xla_hlo_sharding(x.ndim), sharding._to_xla_hlo_sharding(x.ndim)
  except (AttributeError, NotImplementedError):  # a sharding with no HLO form: assume not
    return False
  return src.num_devices == sharding.num_devices and hlo[0] == hlo[1]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _join(pieces: list[jax.Array], where: tuple, shape: tuple) -> jax.Array:
  """The whole array of `shape` from its `pieces`, each at `where` ((start, stop) a dim)."""
  out = jnp.zeros(shape, pieces[0].dtype)
  for piece, bounds in zip(pieces, where, strict=True):
    out = out.at[tuple(slice(a, b) for a, b in bounds)].set(piece)
  return out
