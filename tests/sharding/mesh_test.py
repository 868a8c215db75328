"""Tests for jaxrl.sharding.mesh on the 8 simulated CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.sharding import MESH_AXES, make_mesh, split_devices


@pytest.fixture
def devices():
  devices = jax.devices()
  assert len(devices) == 8, "tests/conftest.py should give 8 CPU devices"
  return devices


@pytest.mark.parametrize(
  "axes, shape",
  [
    ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 2, 1)),
    ({"tensor": 8}, (1, 1, 8, 1)),
    ({"expert": 4, "data": 2}, (2, 1, 1, 4)),
    ({"fsdp": -1}, (1, 8, 1, 1)),
    ({"data": 2, "tensor": -1}, (2, 1, 4, 1)),
    ({"data": 2, "fsdp": 2, "tensor": 2, "expert": -1}, (2, 2, 2, 1)),
  ],
)
def test_make_mesh_shape(devices, axes, shape):
  mesh = make_mesh(devices, axes)
  assert mesh.axis_names == MESH_AXES
  assert tuple(mesh.shape.values()) == shape
  assert mesh.devices.shape == shape


def test_make_mesh_missing_axes_are_size_one(devices):
  mesh = make_mesh(devices[:1], {})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  assert mesh.devices.flat[0] == devices[0]


def test_make_mesh_keeps_the_given_device_order(devices):
  order = np.random.default_rng(0).permutation(len(devices))
  shuffled = [devices[i] for i in order]
  mesh = make_mesh(shuffled, {"data": 2, "tensor": 4})
  assert list(mesh.devices.flat) == shuffled
  # Row-major over MESH_AXES: tensor varies fastest.
  assert mesh.devices[1, 0, 2, 0] == shuffled[1 * 4 + 2]


def test_make_mesh_accepts_numpy_sizes(devices):
  mesh = make_mesh(devices, {"data": np.int64(4), "tensor": 2})
  assert dict(mesh.shape)["data"] == 4


def test_make_mesh_unknown_axis(devices):
  with pytest.raises(ValueError, match=r"(?s)'model'.*'data', 'fsdp', 'tensor', 'expert'"):
    make_mesh(devices, {"data": 2, "model": 4})


def test_make_mesh_product_mismatch_names_sizes_and_count(devices):
  with pytest.raises(ValueError) as e:
    make_mesh(devices, {"data": 3, "tensor": 2})
  message = str(e.value)
  assert "data=3" in message and "tensor=2" in message
  assert "need 6 devices" in message and "8 were given" in message


def test_make_mesh_too_few_devices(devices):
  with pytest.raises(ValueError, match="need 16 devices but 8"):
    make_mesh(devices, {"data": 4, "tensor": 4})


def test_make_mesh_fill_not_divisible(devices):
  with pytest.raises(ValueError, match=r"(?s)fill mesh axis 'tensor'.*8 devices.*product 3"):
    make_mesh(devices, {"data": 3, "tensor": -1})


def test_make_mesh_two_fills(devices):
  with pytest.raises(ValueError, match=r"At most one mesh axis may be -1.*'data', 'tensor'"):
    make_mesh(devices, {"data": -1, "tensor": -1})


@pytest.mark.parametrize("size", [0, -2])
def test_make_mesh_size_below_one(devices, size):
  with pytest.raises(ValueError, match=f">= 1.*fsdp={size}"):
    make_mesh(devices, {"data": 2, "fsdp": size})


@pytest.mark.parametrize("size", [2.0, "2", True])
def test_make_mesh_non_int_size(devices, size):
  with pytest.raises(ValueError, match="'data' size must be an int"):
    make_mesh(devices, {"data": size, "tensor": -1})


def test_make_mesh_empty_and_duplicate_devices(devices):
  with pytest.raises(ValueError, match="at least one device"):
    make_mesh([], {})
  with pytest.raises(ValueError, match="more than once"):
    make_mesh([devices[0], devices[0]], {"data": 2})


def test_split_devices_disjoint_consecutive(devices):
  groups = split_devices(devices, [2, 4, 2])
  assert [len(g) for g in groups] == [2, 4, 2]
  assert groups[0] == devices[0:2] and groups[1] == devices[2:6] and groups[2] == devices[6:8]
  flat = [d for g in groups for d in g]
  assert len(set(flat)) == len(flat) == 8


def test_split_devices_leaves_the_rest_unused(devices):
  groups = split_devices(devices, [3, 1])
  assert groups == [devices[0:3], devices[3:4]]


def test_split_devices_too_many(devices):
  with pytest.raises(ValueError) as e:
    split_devices(devices, [4, 4, 2])
  message = str(e.value)
  assert "[4, 4, 2]" in message and "add up to 10" in message and "only 8 devices" in message


@pytest.mark.parametrize("sizes", [[2, 0], [-1, 2]])
def test_split_devices_size_below_one(devices, sizes):
  with pytest.raises(ValueError, match=r"sizes must be >= 1"):
    split_devices(devices, sizes)


def test_sub_meshes_hold_only_their_devices(devices):
  train_devices, rollout_devices = split_devices(devices, [4, 4])
  train_mesh = make_mesh(train_devices, {"fsdp": 2, "tensor": 2})
  rollout_mesh = make_mesh(rollout_devices, {"data": -1})
  x = np.random.default_rng(1).normal(size=(8, 6)).astype(np.float32)
  for mesh, group in [(train_mesh, train_devices), (rollout_mesh, rollout_devices)]:
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec(*mesh.axis_names[:2])))
    assert {shard.device for shard in placed.addressable_shards} == set(group)
    np.testing.assert_array_equal(np.asarray(placed), x)
