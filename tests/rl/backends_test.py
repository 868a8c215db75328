"""Every backend's learner, store and rollout worker implement the loop's protocols whole."""

import inspect

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.rl.backends import PolicyLearner, VersionedStore
from jaxrl.rl.weights import (
  LeafShards,
  WeightStore,
  WireBits,
  assemble_shards,
  from_wire,
  owned_shards,
  to_wire,
)
from jaxrl.rl.workers import LocalWorker, RolloutWorker
from jaxrl.sharding import make_mesh
from jaxrl.train.learner import Learner

ray_backend = pytest.importorskip("jaxrl.rl.ray_backend")
ray_rollout = pytest.importorskip("jaxrl.rl.ray_rollout")


def members(protocol) -> set[str]:
  """The protocol's methods, properties and attributes (what the loop may touch)."""
  names = {n for n, _ in inspect.getmembers(protocol) if not n.startswith("_")}
  return names | set(getattr(protocol, "__annotations__", {}))


def defines(cls, name: str) -> bool:
  """`cls` has `name` as a method or property, or assigns `self.name` in its constructor."""
  source = inspect.getsource(cls)
  return hasattr(cls, name) or f"self.{name} =" in source or f"self.{name}:" in source


@pytest.mark.parametrize(
  ("protocol", "classes"),
  [
    (PolicyLearner, [Learner, ray_backend.RayLearner]),
    (VersionedStore, [WeightStore, ray_backend.RayWeightStore]),
    (RolloutWorker, [LocalWorker, ray_rollout.RayWorker]),
  ],
)
def test_each_backend_implements_the_whole_protocol(protocol, classes):
  assert members(protocol)
  for cls in classes:
    missing = sorted(n for n in members(protocol) if not defines(cls, n))
    assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"
    for name in members(protocol):
      ours, theirs = getattr(protocol, name, None), getattr(cls, name, None)
      if inspect.isfunction(ours) and inspect.isfunction(theirs):
        wanted = [p.name for p in inspect.signature(ours).parameters.values()]
        assert [p.name for p in inspect.signature(theirs).parameters.values()] == wanted, (
          f"{cls.__name__}.{name}"
        )


def test_a_lent_version_is_recalled_and_a_copy_is_not():
  store = WeightStore()
  store.publish({"w": 1}, 0)
  store.recall(0)
  assert store.pull(-1) is None  # a late reader gets nothing, never the donated buffers
  with pytest.raises(RuntimeError, match="Version 0 was lent"):
    store.latest()
  assert store.version == 0
  store.publish({"w": 2}, 1)
  store.recall(0)  # an older version: nothing to take back
  assert store.pull(0) == (1, {"w": 2})
  store.wait_for(1)
  with pytest.raises(RuntimeError, match="holds version 1, not 2"):
    store.wait_for(2)


def test_a_version_published_in_parts_appears_whole_and_never_torn():
  """Two processes of a learner gang each own half of a parameter (`owned_shards`): the
  store shows the version only when both halves are in, assembled."""
  whole = np.arange(12.0).reshape(4, 3)
  halves = [
    {"w": LeafShards((4, 3), whole.dtype, [((slice(r * 2, r * 2 + 2), slice(None)), part)])}
    for r, part in enumerate(np.split(whole, 2))
  ]
  store = WeightStore()
  store.publish({"w": np.zeros((4, 3))}, 0)
  store.publish_part(1, 1, 2, halves[1])
  assert store.version == 0  # half a version is not a version
  with pytest.raises(ValueError, match="sent twice"):
    store.publish_part(1, 1, 2, halves[1])
  store.publish_part(1, 0, 2, halves[0])
  version, params = store.pull(0)
  assert version == 1 and np.array_equal(params["w"], whole)
  with pytest.raises(ValueError, match="cover 6 of its 12 elements"):
    store.publish_part(2, 0, 1, halves[0])


def test_bf16_arrays_cross_ray_as_their_bits_and_come_back_equal():
  """Ray copies arrays of ml_dtypes' dtypes through pickle and sends integer arrays without a
  copy: the store actor hands out bf16 weights as their bits (`to_wire`), shards travel so
  (`owned_shards`), and readers get back the same arrays (views, not copies)."""
  bf16 = np.dtype(jax.numpy.bfloat16)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(4, 3)).astype(bf16), "b": np.arange(3.0, dtype=np.float32)}
  wire = to_wire((7, params))
  assert isinstance(wire[1]["w"], WireBits) and wire[1]["w"].bits.dtype == np.uint16
  assert wire[1]["b"] is params["b"]  # native dtypes as they are
  version, back = from_wire(wire)
  assert version == 7 and back["w"].dtype == bf16
  np.testing.assert_array_equal(back["w"], params["w"])
  assert np.shares_memory(back["w"], params["w"])
  assert from_wire(to_wire(None)) is None  # nothing newer to pull
  # Shards of a bf16 parameter split over two devices travel as bits and assemble to it.
  mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
  array = jax.device_put(params["w"], NamedSharding(mesh, PartitionSpec("fsdp")))
  shards = owned_shards({"w": array})
  assert all(values.dtype == np.uint16 for _, values in shards["w"].pieces)
  assembled = assemble_shards([shards])
  assert assembled["w"].dtype == bf16
  np.testing.assert_array_equal(assembled["w"], params["w"])
