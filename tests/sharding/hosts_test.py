"""`move_between_devices`: arrays onto other devices of the process, never read whole onto the
host, equal to what `device_put` gives."""

import jax
import numpy as np
import pytest
from helpers.host_reads import whole_arrays_read_on_the_host
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.sharding import make_mesh, move_between_devices


@pytest.mark.parametrize(
  ("source", "target"),
  [
    (({"fsdp": 4}, P("fsdp", None)), ({"tensor": 2}, P(None, "tensor"))),  # rows to columns
    (({"fsdp": 2, "tensor": 2}, P("fsdp", "tensor")), ({"data": 2}, P())),  # 2-D to replicated
    (({"data": 4}, P()), ({"data": 2, "tensor": 2}, P("tensor", None))),  # replicated to rows
    (({"fsdp": 4}, P("fsdp", None)), ({"fsdp": 4}, P("fsdp", None))),  # the same pieces
    (({"fsdp": 4}, P(None, "fsdp")), ({"tensor": 1}, P())),  # onto one device
  ],
)
def test_arrays_move_between_devices_without_a_host_read(source, target, monkeypatch):
  devices = jax.devices()
  (src_axes, src_spec), (dst_axes, dst_spec) = source, target
  dst_size = int(np.prod(list(dst_axes.values())))
  src_mesh = make_mesh(devices[:4], src_axes)
  dst_mesh = make_mesh(devices[4 : 4 + dst_size], dst_axes)
  rng = np.random.default_rng(0)
  value = rng.normal(size=(8, 12)).astype(np.float32)
  x = jax.device_put(value, NamedSharding(src_mesh, src_spec))
  dst = NamedSharding(dst_mesh, dst_spec)
  with whole_arrays_read_on_the_host(monkeypatch) as reads:
    moved = move_between_devices({"w": x}, {"w": dst})["w"]
    jax.block_until_ready(moved)
  assert not reads
  assert moved.sharding == dst
  np.testing.assert_array_equal(np.asarray(moved), value)
  for shard in moved.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_a_tree_moves_whole_with_a_small_bound_on_joined_arrays_in_flight():
  """Past the bound the move waits for the joined arrays' copies; the tree arrives the same."""
  devices = jax.devices()
  src = NamedSharding(make_mesh(devices[:4], {"fsdp": 4}), P("fsdp"))
  dst = NamedSharding(make_mesh(devices[4:6], {"tensor": 2}), P(None, "tensor"))
  rng = np.random.default_rng(1)
  values = {f"w{i}": rng.normal(size=(8, 4 * (i + 1))).astype(np.float32) for i in range(3)}
  tree = {k: jax.device_put(v, src) for k, v in values.items()}
  moved = move_between_devices(tree, dict.fromkeys(tree, dst), joined_bytes_in_flight=1)
  for key, value in values.items():
    assert moved[key].sharding == dst
    np.testing.assert_array_equal(np.asarray(moved[key]), value)
