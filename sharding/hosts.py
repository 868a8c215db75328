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
"""

from __future__ import annotations

import jax
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
