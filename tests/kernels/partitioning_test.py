"""The kernels on each device's rows and heads (`jaxrl.kernels.partitioning`).

The kernels run in Pallas' interpreters on the 8 simulated CPU devices, inside the
`shard_map` that `KernelMesh` asks for. Without it, XLA's partitioner gathers every operand of
a compiled GPU kernel onto every device (and a TPU refuses the program); the GPU interpreter
shows the gathers too, so these tests count the collectives of the compiled program.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.kernels import paged_attention, qk_rope_write
from jaxrl.kernels.flash_attention import flash_attention
from jaxrl.kernels.partitioning import KernelMesh, split_call
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, kernel_mesh, make_mesh

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def _collectives(compiled) -> dict[str, int]:
  text = compiled.as_text()
  counts = {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in COLLECTIVES}
  return {op: n for op, n in counts.items() if n}


def _mesh(**axes):
  size = int(np.prod(list(axes.values())))
  return make_mesh(jax.devices()[:size], axes)


def _put(mesh, x, *spec):
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _paged_inputs(seed=0, n=4, h=8, k=4, d=64, p=16, s=16, m=4):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (n, h, d), jnp.float32)
  k_pages = jax.random.normal(ks[1], (k, p, s, d), jnp.float32)
  v_pages = jax.random.normal(ks[2], (k, p, s, d), jnp.float32)
  lengths = jnp.array([5, 17, 64, 0][:n], jnp.int32)
  table = jax.random.permutation(ks[3], p)[: n * m].reshape(n, m).astype(jnp.int32)
  sinks = jax.random.normal(ks[4], (h,), jnp.float32)
  return q, k_pages, v_pages, lengths, table, sinks


@pytest.mark.parametrize(("impl", "with_sinks"), [("pallas_gpu", False), ("pallas_gpu", True),
                                                   ("pallas_tpu", True)])  # fmt: skip
def test_paged_attention_stays_on_each_devices_rows_and_heads(impl, with_sinks):
  mesh = _mesh(data=2, tensor=2)
  split = KernelMesh(mesh, rows=("data",), heads=("tensor",))
  q, k_pages, v_pages, lengths, table, sinks = _paged_inputs()
  args = (
    _put(mesh, q, "data", "tensor"), _put(mesh, k_pages, "tensor"), _put(mesh, v_pages, "tensor"),
    _put(mesh, lengths, "data"), _put(mesh, table, "data"), _put(mesh, sinks, "tensor"),
  )  # fmt: skip

  def attend(q, k_pages, v_pages, lengths, table, sinks, mesh=split):
    return paged_attention(
      q, k_pages, v_pages, lengths, table, sinks=sinks if with_sinks else None, impl=impl,
      interpret=True, mesh=mesh,
    )  # fmt: skip

  run = jax.jit(attend)
  out = run(*args)
  expected = paged_attention(
    q, k_pages, v_pages, lengths, table, sinks=sinks if with_sinks else None, impl="reference"
  )
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec == P("data", "tensor")
  assert _collectives(run.lower(*args).compile()) == {}
  if impl == "pallas_gpu":  # without the mesh: the pools gathered whole onto every device
    whole = jax.jit(lambda *a: attend(*a, mesh=None))
    assert "all-gather" in _collectives(whole.lower(*args).compile())


def test_qk_rope_write_keeps_the_pools_split_over_kv_heads():
  mesh = _mesh(data=2, tensor=4)
  split = KernelMesh(mesh, rows=("data",), heads=("tensor",))
  n, h, k, e, p, z = 3, 8, 4, 64, 8, 4
  ks = jax.random.split(jax.random.key(1), 6)
  q = jax.random.normal(ks[0], (n, h, e), jnp.float32)
  kk = jax.random.normal(ks[1], (n, k, e), jnp.float32)
  v = jax.random.normal(ks[2], (n, k, e), jnp.float32)
  angles = jax.random.uniform(ks[3], (n, e // 2)) * 6
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  rows = jnp.array([5, -1, 30], jnp.int32)  # a padding token writes nothing
  k_pages = jax.random.normal(ks[4], (k, p, z, e), jnp.float32)
  v_pages = jax.random.normal(ks[5], (k, p, z, e), jnp.float32)
  scale = jnp.linspace(0.5, 1.5, e)
  args = (
    _put(mesh, q, None, "tensor"), _put(mesh, kk, None, "tensor"), _put(mesh, v, None, "tensor"),
    _put(mesh, cos), _put(mesh, sin), _put(mesh, rows), _put(mesh, k_pages, "tensor"),
    _put(mesh, v_pages, "tensor"), _put(mesh, scale), _put(mesh, scale[::-1]),
  )  # fmt: skip

  def write(q, k, v, cos, sin, rows, k_pages, v_pages, q_scale, k_scale):
    return qk_rope_write(
      q, k, v, cos, sin, rows, k_pages, v_pages, q_scale=q_scale, k_scale=k_scale,
      impl="pallas_gpu", interpret=True, mesh=split,
    )  # fmt: skip

  run = jax.jit(write)
  got = run(*args)
  expected = qk_rope_write(
    q, kk, v, cos, sin, rows, k_pages, v_pages, q_scale=scale, k_scale=scale[::-1],
    impl="reference",
  )  # fmt: skip
  for g, x in zip(got, expected, strict=True):
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5)
  assert got[1].sharding.spec == P("tensor") and got[2].sharding.spec == P("tensor")
  # Every token is written on every device (tokens are not split: the pools' copies over
  # `data` must all get them), so nothing crosses devices.
  assert _collectives(run.lower(*args).compile()) == {}
  # The interpreted kernel is plain XLA, which the partitioner splits well enough by itself;
  # the compiled one is a custom call it gathered (compiled for two H100s: both pools of every
  # layer, docs/BENCHMARKS.md). So here: the call runs in a shard_map.
  assert "shard_map" in str(jax.make_jaxpr(write)(*args))


@pytest.mark.parametrize(("impl", "with_sinks"), [("pallas_gpu", False), ("pallas_gpu", True),
                                                   ("pallas_tpu", False)])  # fmt: skip
def test_flash_attention_forward_and_backward_stay_on_each_devices_rows_and_heads(impl, with_sinks):
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  split = kernel_mesh(mesh, TRAIN_RULES)  # rows over data and fsdp, heads over tensor
  b, t, h, k, e = 4, 32, 4, 2, 32
  ks = jax.random.split(jax.random.key(2), 5)
  q = jax.random.normal(ks[0], (b, t, h, e), jnp.float32)
  kk = jax.random.normal(ks[1], (b, t, k, e), jnp.float32)
  v = jax.random.normal(ks[2], (b, t, k, e), jnp.float32)
  cotangent = jax.random.normal(ks[3], (b, t, h, e), jnp.float32)
  sinks = jax.random.normal(ks[4], (h,), jnp.float32)
  segments = jnp.repeat(jnp.arange(2), t // 2)[None].repeat(b, 0).astype(jnp.int32)
  positions = jnp.tile(jnp.arange(t // 2), 2)[None].repeat(b, 0).astype(jnp.int32)

  def loss(q, k, v, segments, positions, sinks, impl, interpret, mesh):
    out = flash_attention(
      q, k, v, q_segment_ids=segments, kv_segment_ids=segments, q_positions=positions,
      kv_positions=positions, sinks=sinks if with_sinks else None, impl=impl,
      interpret=interpret, mesh=mesh,
    )  # fmt: skip
    return jnp.sum(out * cotangent)

  grad = jax.grad(loss, argnums=(0, 1, 2, 5))
  run = jax.jit(lambda *a: grad(*a, impl, True, split))
  rows = ("data", "fsdp")
  args = (
    _put(mesh, q, rows, None, "tensor"), _put(mesh, kk, rows, None, "tensor"),
    _put(mesh, v, rows, None, "tensor"), _put(mesh, segments, rows),
    _put(mesh, positions, rows), _put(mesh, sinks, "tensor"),
  )  # fmt: skip
  got = run(*args)
  expected = grad(q, kk, v, segments, positions, sinks, "reference", False, None)
  for g, x in zip(got[:3], expected[:3], strict=True):
    np.testing.assert_allclose(g, x, rtol=2e-4, atol=2e-4)
  if with_sinks:  # the sinks' gradient sums over rows: the one collective there is
    np.testing.assert_allclose(got[3], expected[3], rtol=2e-4, atol=2e-4)
  assert got[0].sharding.spec == P(rows, None, "tensor")
  found = _collectives(run.lower(*args).compile())
  assert "all-gather" not in found and "all-to-all" not in found, found
  if impl == "pallas_gpu":
    whole = jax.jit(lambda *a: grad(*a, impl, True, None))
    assert "all-gather" in _collectives(whole.lower(*args).compile())


def test_split_call_checks_its_rule_and_calls_plainly_on_one_device():
  x = jnp.arange(12.0).reshape(6, 2)
  one = KernelMesh(_mesh(data=1), rows=("data",))
  with pytest.raises(ValueError, match="names 2 operands, got 1"):
    split_call(lambda a, b: a, "i j, i -> i j", one, x, rows=("i",))
  with pytest.raises(ValueError, match=r"gives \('i',\) for an operand of shape \(6, 2\)"):
    split_call(lambda a: a, "i -> i", one, x, rows=("i",))

  def jaxpr(kernel_mesh):
    def call(a):
      return split_call(lambda y: y * 2, "i j -> i j", kernel_mesh, a, rows=("i",), heads=("j",))

    return str(jax.make_jaxpr(call)(x))

  mesh = _mesh(data=2, tensor=4)
  assert "in_specs=(P('data', None),)" in jaxpr(KernelMesh(mesh, rows=("data",)))
  assert "shard_map" not in jaxpr(one)  # one device
  assert "shard_map" not in jaxpr(None)
  # 2 heads do not split over 4 devices, nor 6 rows over 4: whole operands on each device,
  # still in a shard_map (a TPU compiles no kernel outside one).
  assert "in_specs=(P(None, None),)" in jaxpr(KernelMesh(mesh, heads=("tensor",)))
  assert "in_specs=(P(None, None),)" in jaxpr(KernelMesh(_mesh(data=4), rows=("data",)))


def test_kernel_mesh_follows_the_stages_rules():
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  assert kernel_mesh(mesh, TRAIN_RULES) == KernelMesh(mesh, ("data", "fsdp"), ("tensor",))
  assert kernel_mesh(mesh, ROLLOUT_RULES) == KernelMesh(mesh, ("data",), ("tensor",))
  experts = _mesh(expert=4)  # nothing splits, but the kernels still need their shard_map
  assert kernel_mesh(experts, TRAIN_RULES) == KernelMesh(experts, (), ())
  assert kernel_mesh(_mesh(data=1), TRAIN_RULES) is None


def test_page_writes_stay_on_each_devices_kv_heads():
  from jaxrl.model.cache import write_pages

  mesh = _mesh(data=2, tensor=4)
  split = kernel_mesh(mesh, ROLLOUT_RULES)
  b, t, k, e, p, z = 2, 6, 4, 16, 8, 4
  ks = jax.random.split(jax.random.key(3), 2)
  pages = jax.random.normal(ks[0], (k, p, z, e), jnp.float32)
  new = jax.random.normal(ks[1], (b, t, k, e), jnp.float32)
  page_bt = jnp.array([[0, 0, 3, 3, 8, 8], [5, 5, 5, 5, 1, 1]], jnp.int32)  # page 8: outside
  slot_bt = jnp.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 2]], jnp.int32)
  args = (
    _put(mesh, pages, "tensor"), _put(mesh, new, "data", None, "tensor"),
    _put(mesh, page_bt, "data"), _put(mesh, slot_bt, "data"),
  )  # fmt: skip
  run = jax.jit(lambda *a: write_pages(*a, kernel_mesh=split))
  got = run(*args)
  np.testing.assert_array_equal(got, write_pages(pages, new, page_bt, slot_bt))
  assert got.sharding.spec == P("tensor")
  # Every token to every device of `data` (each holds a copy of the pool), nothing over
  # `tensor`: left to XLA, the scatter gathered the new rows over the heads' axis too.
  found = _collectives(run.lower(*args).compile())
  assert set(found) <= {"all-gather"}, found
  whole = jax.jit(lambda *a: write_pages(*a, kernel_mesh=None))
  assert _collectives(whole.lower(*args).compile()).get("all-gather", 0) > found.get(
    "all-gather", 0
  )
