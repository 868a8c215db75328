"""Tests for jaxrl.sharding.rules on the 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.sharding import (
  LOGICAL_AXES,
  ROLLOUT_RULES,
  STAGE_RULES,
  TRAIN_RULES,
  batch_sharding,
  check_rules,
  logical_to_pspec,
  make_mesh,
  tree_shardings,
)


@pytest.fixture
def train_mesh():
  return make_mesh(jax.devices(), {"data": 2, "fsdp": 2, "tensor": 2})


@pytest.fixture
def rollout_mesh():
  return make_mesh(jax.devices(), {"data": 2, "tensor": 4})


def _random(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# check_rules


def test_stage_rules_cover_every_logical_axis():
  assert STAGE_RULES == {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}
  for rules in STAGE_RULES.values():
    check_rules(rules, LOGICAL_AXES)
  assert dict(TRAIN_RULES)["embed"] == "fsdp"
  assert dict(ROLLOUT_RULES)["embed"] is None
  assert not any("fsdp" in str(target) for _, target in ROLLOUT_RULES)


def test_check_rules_conflict_names_both_rules():
  rules = (*TRAIN_RULES, ("embed", "tensor"))
  with pytest.raises(ValueError, match=r"Conflicting.*'embed'.*\('embed', 'fsdp'\).*'tensor'"):
    check_rules(rules, LOGICAL_AXES)


def test_check_rules_conflict_even_when_identical():
  with pytest.raises(ValueError, match="Conflicting rules for logical axis 'mlp'"):
    check_rules((("mlp", "tensor"), ("mlp", "tensor")), ["mlp"])


def test_check_rules_unused_rule():
  used = [name for name in LOGICAL_AXES if name != "length"]
  with pytest.raises(ValueError, match=r"rule \('length', \(\)\) is unused"):
    check_rules(TRAIN_RULES, used)


def test_check_rules_unknown_mesh_axis():
  with pytest.raises(ValueError, match=r"\('embed', \('model',\)\).*unknown mesh axis \['model'\]"):
    check_rules((("embed", "model"),), ["embed"])


def test_check_rules_used_name_without_rule():
  with pytest.raises(ValueError, match="'experts' is used but has no rule"):
    check_rules(TRAIN_RULES, [*LOGICAL_AXES, "experts"])


def test_check_rules_reports_every_problem():
  with pytest.raises(ValueError) as e:
    check_rules((("embed", "model"), ("mlp", "tensor")), ["embed", "heads"])
  message = str(e.value)
  assert "'model'" in message and "'mlp'" in message and "'heads'" in message


@pytest.mark.parametrize(
  "rule, match",
  [
    (("embed",), "must be a .logical_name, mesh_axes. pair"),
    (("embed", 3), "must map to a mesh axis name"),
    (("embed", ("fsdp", "fsdp")), "more than once"),
  ],
)
def test_check_rules_malformed(rule, match):
  with pytest.raises(ValueError, match=match):
    check_rules((rule,), ["embed"])


# logical_to_pspec


@pytest.mark.parametrize(
  "logical_axes, expected",
  [
    (("embed", "mlp"), P("fsdp", "tensor")),
    (("mlp", "embed"), P("tensor", "fsdp")),
    (("vocab", "embed"), P("tensor", "fsdp")),
    (("embed", "heads", "head_dim"), P("fsdp", "tensor", None)),
    (("embed", "kv_heads", "head_dim"), P("fsdp", "tensor", None)),
    (("norm",), P(None)),
    ((None, "mlp"), P(None, "tensor")),
    ((), P()),
    # The size-1 expert axis is dropped.
    (("expert", "embed", "mlp"), P(None, "fsdp", "tensor")),
    # fsdp is already taken by batch, so embed is replicated.
    (("batch", "length", "embed"), P(("data", "fsdp"), None, None)),
    # tensor is used once: the later dimension is replicated.
    (("heads", "mlp"), P("tensor", None)),
  ],
)
def test_pspec_train(train_mesh, logical_axes, expected):
  assert logical_to_pspec(logical_axes, TRAIN_RULES, train_mesh) == expected


@pytest.mark.parametrize(
  "logical_axes, expected",
  [
    (("embed", "mlp"), P(None, "tensor")),
    (("vocab", "embed"), P("tensor", None)),
    (("batch", "length", "embed"), P("data", None, None)),
    (("expert", "embed", "mlp"), P(None, None, "tensor")),
  ],
)
def test_pspec_rollout(rollout_mesh, logical_axes, expected):
  assert logical_to_pspec(logical_axes, ROLLOUT_RULES, rollout_mesh) == expected


def test_pspec_drops_size_one_axes(rollout_mesh):
  # Train rules on a mesh without fsdp: batch is over data only, embed is replicated.
  assert logical_to_pspec(("batch", "embed"), TRAIN_RULES, rollout_mesh) == P("data", None)
  one_device = make_mesh(jax.devices()[:1], {})
  assert logical_to_pspec(("batch", "embed", "mlp"), TRAIN_RULES, one_device) == P(None, None, None)


def test_pspec_expert_mesh():
  mesh = make_mesh(jax.devices(), {"data": 2, "expert": 4})
  spec = logical_to_pspec(("expert", "embed", "mlp"), ROLLOUT_RULES, mesh)
  assert spec == P("expert", None, None)


def test_pspec_partial_overlap_keeps_the_free_axes(train_mesh):
  rules = (("a", ("data", "tensor")), ("b", ("tensor", "fsdp")))
  assert logical_to_pspec(("a", "b"), rules, train_mesh) == P(("data", "tensor"), "fsdp")


def test_pspec_accepts_partition_spec_of_logical_names(train_mesh):
  assert logical_to_pspec(P("embed", "mlp"), TRAIN_RULES, train_mesh) == P("fsdp", "tensor")


def test_pspec_divisible_shape_passes(train_mesh):
  spec = logical_to_pspec(("batch", "embed", "mlp"), TRAIN_RULES, train_mesh, (4, 6, 2))
  assert spec == P(("data", "fsdp"), None, "tensor")
  # Replicated and size-1 dimensions need no divisibility.
  assert logical_to_pspec(("expert", "norm"), TRAIN_RULES, train_mesh, (3, 5)) == P(None, None)


def test_pspec_not_divisible_names_axis_size_and_suggests_mesh(train_mesh):
  with pytest.raises(ValueError) as e:
    logical_to_pspec(("batch", "length"), TRAIN_RULES, train_mesh, (6, 16))
  message = str(e.value)
  assert "'batch'" in message and "size 6" in message and "('data', 'fsdp')" in message
  assert "4 shards" in message and "data=2, fsdp=1" in message


def test_pspec_not_divisible_single_axis(train_mesh):
  with pytest.raises(ValueError, match=r"(?s)'mlp'.*size 7.*\('tensor',\).*e\.g\. tensor=1"):
    logical_to_pspec(("embed", "mlp"), TRAIN_RULES, train_mesh, (8, 7))


def test_pspec_errors(train_mesh):
  with pytest.raises(ValueError, match="2 entries but the shape"):
    logical_to_pspec(("embed", "mlp"), TRAIN_RULES, train_mesh, (8,))
  with pytest.raises(ValueError, match="'experts' has no rule"):
    logical_to_pspec(("experts",), TRAIN_RULES, train_mesh)
  with pytest.raises(ValueError, match="mesh axis 'model', which the mesh"):
    logical_to_pspec(("embed",), (("embed", "model"),), train_mesh)
  with pytest.raises(ValueError, match="Conflicting"):
    logical_to_pspec(("embed",), (("embed", "fsdp"), ("embed", None)), train_mesh)
  with pytest.raises(ValueError, match="must be a tuple of logical axis names"):
    logical_to_pspec((("embed", "mlp"),), TRAIN_RULES, train_mesh)


# tree_shardings and placement on devices


def _params_logical():
  return {
    "embedder": {"table": ("vocab", "embed")},
    "layers": [
      {
        "mlp": {"wi": ("embed", "mlp"), "wo": ("mlp", "embed")},
        "attn": {"q": ("embed", "heads", "head_dim")},
        "norm": ("norm",),
      }
    ],
    "pair": (("embed", "mlp"), ("mlp",)),
    "step": (),
  }


def _init(key):
  keys = jax.random.split(key, 6)
  return {
    "embedder": {"table": jax.random.normal(keys[0], (16, 8))},
    "layers": [
      {
        "mlp": {
          "wi": jax.random.normal(keys[1], (8, 12)),
          "wo": jax.random.normal(keys[2], (12, 8)),
        },
        "attn": {"q": jax.random.normal(keys[3], (8, 4, 3))},
        "norm": 1.0 + jax.random.normal(keys[4], (8,)),
      }
    ],
    "pair": (jax.random.normal(keys[5], (8, 4)), jnp.arange(12.0)),
    "step": jnp.array(3, jnp.int32),
  }


def test_tree_shardings_specs(train_mesh):
  shapes = jax.eval_shape(_init, jax.random.key(0))
  shardings = tree_shardings(_params_logical(), train_mesh, TRAIN_RULES, shapes)
  assert jax.tree.structure(shardings) == jax.tree.structure(shapes)
  specs = jax.tree.map(lambda s: s.spec, shardings)
  assert specs == {
    "embedder": {"table": P("tensor", "fsdp")},
    "layers": [
      {
        "mlp": {"wi": P("fsdp", "tensor"), "wo": P("tensor", "fsdp")},
        "attn": {"q": P("fsdp", "tensor", None)},
        "norm": P(None),
      }
    ],
    "pair": (P("fsdp", "tensor"), P("tensor")),
    "step": P(),
  }
  assert all(s.mesh == train_mesh for s in jax.tree.leaves(shardings))


def test_tree_shardings_jit_init_lands_shards(train_mesh):
  """eval_shape -> shardings -> jit(init, out_shardings): each shard where the spec says."""
  key = jax.random.key(0)
  shardings = tree_shardings(_params_logical(), train_mesh, TRAIN_RULES, jax.eval_shape(_init, key))
  params = jax.jit(_init, out_shardings=shardings)(key)
  expected = _init(key)
  wi = params["layers"][0]["mlp"]["wi"]
  assert wi.sharding == NamedSharding(train_mesh, P("fsdp", "tensor"))
  assert [s.data.shape for s in wi.addressable_shards] == [(4, 6)] * 8
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  assert params["step"].addressable_shards[0].data.shape == ()


def test_tree_shardings_rollout_layout(rollout_mesh):
  shardings = tree_shardings(
    _params_logical(), rollout_mesh, ROLLOUT_RULES, jax.eval_shape(_init, jax.random.key(0))
  )
  assert shardings["layers"][0]["mlp"]["wi"].spec == P(None, "tensor")
  assert shardings["embedder"]["table"].spec == P("tensor", None)


def test_tree_shardings_without_shapes_and_none_leaf(train_mesh):
  shardings = tree_shardings({"w": ("embed", "mlp"), "b": None}, train_mesh, TRAIN_RULES)
  assert shardings["w"].spec == P("fsdp", "tensor")
  assert shardings["b"].spec == P()


def test_tree_shardings_shape_tuples(train_mesh):
  shardings = tree_shardings(
    {"w": ("embed", "mlp")}, train_mesh, TRAIN_RULES, shapes_tree={"w": (4, 6)}
  )
  assert shardings["w"].spec == P("fsdp", "tensor")


def test_tree_shardings_error_names_the_path(train_mesh):
  logical = {"layers": [{"wi": ("embed", "mlp")}]}
  shapes = {"layers": [{"wi": jax.ShapeDtypeStruct((8, 5), jnp.float32)}]}
  with pytest.raises(ValueError, match=r"(?s)At \['layers'\]\[0\]\['wi'\]:.*'mlp'.*size 5"):
    tree_shardings(logical, train_mesh, TRAIN_RULES, shapes)


def test_tree_shardings_structure_mismatch(train_mesh):
  with pytest.raises(ValueError, match="shapes_tree does not have the structure"):
    tree_shardings({"w": ("embed",), "b": ("mlp",)}, train_mesh, TRAIN_RULES, {"w": (4,)})


def test_tree_shardings_bad_leaf(train_mesh):
  with pytest.raises(TypeError, match=r"Leaf at \['w'\] is 'embed'"):
    tree_shardings({"w": "embed"}, train_mesh, TRAIN_RULES)


def test_device_put_lands_blocks_on_mesh_devices(train_mesh):
  x = _random((8, 12))
  sharding = tree_shardings({"w": ("embed", "mlp")}, train_mesh, TRAIN_RULES)["w"]
  placed = jax.device_put(x, sharding)
  shards = placed.addressable_shards
  assert len(shards) == 8
  assert {s.device for s in shards} == set(train_mesh.devices.flat)
  by_device = {s.device: s for s in shards}
  # embed -> fsdp, mlp -> tensor; the data (and size-1 expert) axis replicates.
  for (_, f, t, _), device in np.ndenumerate(train_mesh.devices):
    shard = by_device[device]
    assert shard.data.shape == (4, 6)
    np.testing.assert_array_equal(
      np.asarray(shard.data), x[f * 4 : (f + 1) * 4, t * 6 : (t + 1) * 6]
    )


def test_batch_sharding_train(train_mesh):
  sharding = batch_sharding(train_mesh, TRAIN_RULES, 3)
  assert sharding.spec == P(("data", "fsdp"), None, None)
  x = _random((8, 3, 5), seed=2)
  placed = jax.device_put(x, sharding)
  assert [s.data.shape for s in placed.addressable_shards] == [(2, 3, 5)] * 8
  by_device = {s.device: s for s in placed.addressable_shards}
  for (d, f, _, _), device in np.ndenumerate(train_mesh.devices):
    row = (d * 2 + f) * 2
    np.testing.assert_array_equal(np.asarray(by_device[device].data), x[row : row + 2])


def test_batch_sharding_rollout(rollout_mesh):
  sharding = batch_sharding(rollout_mesh, ROLLOUT_RULES, 2)
  assert sharding.spec == P("data", None)
  x = _random((6, 4), seed=3)
  placed = jax.device_put(x, sharding)
  blocks = {}
  for shard in placed.addressable_shards:
    assert shard.data.shape == (3, 4)
    blocks.setdefault(shard.index[0].start, []).append(shard.device)
  # Two batch blocks, each replicated over the 4 tensor devices.
  assert sorted(blocks) == [0, 3] and all(len(v) == 4 for v in blocks.values())
  np.testing.assert_array_equal(np.asarray(placed), x)


def test_batch_sharding_needs_a_batch_dim(train_mesh):
  with pytest.raises(ValueError, match="ndim >= 1"):
    batch_sharding(train_mesh, TRAIN_RULES, 0)
