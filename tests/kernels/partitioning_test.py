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


def _rope_inputs(seed, *, n, h, k, e, p, z):
  """`qk_rope_write`'s q, k, v, cos, sin and pools for n tokens."""
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (n, h, e), jnp.float32)
  kk = jax.random.normal(ks[1], (n, k, e), jnp.float32)
  v = jax.random.normal(ks[2], (n, k, e), jnp.float32)
  angles = jax.random.uniform(ks[3], (n, e // 2)) * 6
  k_pages = jax.random.normal(ks[4], (k, p, z, e), jnp.float32)
  v_pages = jax.random.normal(ks[5], (k, p, z, e), jnp.float32)
  return q, kk, v, jnp.cos(angles), jnp.sin(angles), k_pages, v_pages


def test_qk_rope_write_keeps_the_pools_split_over_kv_heads():
  mesh = _mesh(data=2, tensor=4)
  split = KernelMesh(mesh, rows=("data",), heads=("tensor",))
  q, kk, v, cos, sin, k_pages, v_pages = _rope_inputs(1, n=3, h=8, k=4, e=64, p=8, z=4)
  rows = jnp.array([5, -1, 30], jnp.int32)  # a padding token writes nothing
  scale = jnp.linspace(0.5, 1.5, q.shape[-1])
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


# -- pools whose pages split with the rows (`KernelMesh.split_pages`) -----------------------------


def _local_tables(rng, n, m, p, shards):
  """Page tables whose row i lists pages of shard i // (n // shards) only (of p in all)."""
  per_rows, per_pages = n // shards, p // shards
  table = np.zeros((n, m), np.int32)
  for i in range(n):
    first = (i // per_rows) * per_pages
    table[i] = first + rng.permutation(per_pages)[:m]
  return jnp.asarray(table)


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu", "pallas_tpu"])
def test_paged_attention_reads_each_rows_pages_on_its_own_device(impl):
  mesh = _mesh(data=2, tensor=2)
  split = kernel_mesh(mesh, ROLLOUT_RULES, split_pages=True)
  assert split.split_pages
  q, k_pages, v_pages, _, _, sinks = _paged_inputs(n=4, p=16)
  lengths = jnp.array([5, 17, 64, 30], jnp.int32)
  table = _local_tables(np.random.default_rng(0), 4, 4, 16, 2)
  args = (
    _put(mesh, q, "data", "tensor"), _put(mesh, k_pages, "tensor", "data"),
    _put(mesh, v_pages, "tensor", "data"), _put(mesh, lengths, "data"), _put(mesh, table, "data"),
    _put(mesh, sinks, "tensor"),
  )  # fmt: skip

  def attend(q, k_pages, v_pages, lengths, table, sinks):
    return paged_attention(
      q, k_pages, v_pages, lengths, table, sinks=sinks, impl=impl,
      interpret=impl != "reference", mesh=split,
    )  # fmt: skip

  run = jax.jit(attend)
  out = run(*args)
  expected = paged_attention(q, k_pages, v_pages, lengths, table, sinks=sinks, impl="reference")
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec == P("data", "tensor")
  assert _collectives(run.lower(*args).compile()) == {}


def test_split_pages_refuse_rows_or_pools_that_do_not_split_with_them():
  mesh = _mesh(data=2, tensor=2)
  split = kernel_mesh(mesh, ROLLOUT_RULES, split_pages=True)
  q, k_pages, v_pages, lengths, table, _ = _paged_inputs(n=3, p=16)  # 3 rows over 2 devices
  with pytest.raises(ValueError, match=r"rows \(\['n'\]\) of a call that reads pages"):
    paged_attention(q, k_pages, v_pages, lengths, table, impl="reference", mesh=split)
  q, k_pages, v_pages, lengths, table, _ = _paged_inputs(n=4, p=15, m=3)
  with pytest.raises(ValueError, match="a KV pool of 15 pages does not split over the 2"):
    paged_attention(q, k_pages, v_pages, lengths, table, impl="reference", mesh=split)


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu"])
def test_qk_rope_write_writes_each_row_on_the_device_of_its_pages(impl):
  mesh = _mesh(data=2, tensor=2)
  split = kernel_mesh(mesh, ROLLOUT_RULES, split_pages=True)
  z = 4
  q, kk, v, cos, sin, k_pages, v_pages = _rope_inputs(4, n=4, h=4, k=2, e=64, p=8, z=z)
  # Rows 0-1 on device 0 of `data` (pages 0-3), rows 2-3 on device 1 (pages 4-7); one padding.
  rows = jnp.array([1 * z + 2, -1, 4 * z + 0, 7 * z + 3], jnp.int32)
  args = (
    _put(mesh, q, "data", "tensor"), _put(mesh, kk, "data", "tensor"),
    _put(mesh, v, "data", "tensor"), _put(mesh, cos, "data"), _put(mesh, sin, "data"),
    _put(mesh, rows, "data"), _put(mesh, k_pages, "tensor", "data"),
    _put(mesh, v_pages, "tensor", "data"),
  )  # fmt: skip

  def write(*a, impl=impl, mesh=split):
    return qk_rope_write(*a, impl=impl, interpret=impl != "reference", mesh=mesh)

  run = jax.jit(write)
  got = run(*args)
  expected = write(q, kk, v, cos, sin, rows, k_pages, v_pages, impl="reference", mesh=None)
  for g, x in zip(got, expected, strict=True):
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5)
  assert got[0].sharding.spec == P("data", "tensor")
  assert got[1].sharding.spec == P("tensor", "data")
  assert _collectives(run.lower(*args).compile()) == {}


def test_page_writes_land_on_the_device_that_holds_the_page():
  """Each row's tokens are written on the devices of its row, which hold its pages; a prefill
  chunk's rows read them back there."""
  from jaxrl.model.cache import gather_pages, write_pages

  mesh = _mesh(data=2, tensor=2)
  split = kernel_mesh(mesh, ROLLOUT_RULES, split_pages=True)
  b, t, k, e, p, z = 2, 6, 2, 16, 8, 4
  ks = jax.random.split(jax.random.key(5), 2)
  pages = jax.random.normal(ks[0], (k, p, z, e), jnp.float32)
  new = jax.random.normal(ks[1], (b, t, k, e), jnp.float32)
  # Row 0 on device 0 of `data` (pages 0-3), row 1 on device 1 (4-7); page 8 is outside.
  page_bt = jnp.array([[0, 0, 3, 3, 8, 8], [5, 5, 5, 5, 6, 6]], jnp.int32)
  slot_bt = jnp.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 2]], jnp.int32)
  args = (
    _put(mesh, pages, "tensor", "data"), _put(mesh, new, "data", None, "tensor"),
    _put(mesh, page_bt, "data"), _put(mesh, slot_bt, "data"),
  )  # fmt: skip
  run = jax.jit(lambda *a: write_pages(*a, kernel_mesh=split))
  got = run(*args)
  np.testing.assert_array_equal(got, write_pages(pages, new, page_bt, slot_bt))
  assert got.sharding.spec == P("tensor", "data")
  assert _collectives(run.lower(*args).compile()) == {}
  table = _local_tables(np.random.default_rng(1), 2, 3, p, 2)
  gather = jax.jit(lambda pages, table: gather_pages(pages, pages, table, split))
  keys, _ = gather(got, _put(mesh, table, "data"))
  want, _ = gather_pages(got, got, table)
  np.testing.assert_array_equal(keys, want)
  assert _collectives(gather.lower(got, _put(mesh, table, "data")).compile()) == {}
