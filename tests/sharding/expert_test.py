"""Tests for jaxrl.sharding.expert on 8 simulated CPU devices: outputs and gradients against the
dense single-device MoE, with and without balancing placements, routing replay, capacity drops
against a numpy model of the drop rule, the ragged exchange, stats, input errors, recompiles.

Letters: t tokens, n tokens of one device, d model width, f expert mlp width, x experts, k top-k,
e devices on the expert axis, s slots of a device, r replicas.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowering, moe_capacity, tolerance

from jaxrl.model.moe import route
from jaxrl.sharding import (
  ExpertParallelConfig,
  PlacementLayer,
  make_mesh,
  moe_expert_parallel,
  placement_arrays,
  plan_placement,
)
from jaxrl.sharding import expert as expert_module

D, F, X, K = 32, 16, 8, 2
TOKENS = 128


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _params(rng, tokens=TOKENS, experts=X):
  def normal(shape, scale):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  return (
    normal((tokens, D), 1.0),
    normal((D, experts), 1.0),
    normal((experts, D, F), D**-0.5),
    normal((experts, D, F), D**-0.5),
    normal((experts, F, D), F**-0.5),
  )


def _mesh(e, **axes):
  return make_mesh(jax.devices(), {"data": 8 // e, "expert": e, **axes})


def _placement(rng, e, method):
  if method is None:
    return None
  loads = (rng.pareto(1.0, (1, X)) * 100).round() + 1  # skewed, never zero
  placement = plan_placement(loads, num_devices=e, redundant_slots=1, method=method)
  assert placement.max_replicas > 1, "the test wants an expert split over replicas"
  return placement_arrays(placement, 0, max_replicas=e)


def _reference(x_td, router_dx, w_gate_xdf, w_up_xdf, w_down_xfd, routes_tk=None, keep_tk=None):
  """The dense dispatch of jaxrl.model.moe: every expert on every token, combine weights zero
  outside the token's routes (and, for capacity drops, on dropped assignments)."""
  logits_tx = x_td @ router_dx
  if routes_tk is None:
    weights_tk, ids_tk = route(logits_tx, K)
  else:
    ids_tk = routes_tk
    weights_tk = jnp.take_along_axis(jax.nn.softmax(logits_tx, -1), ids_tk, -1)
    weights_tk = weights_tk / weights_tk.sum(-1, keepdims=True)
  if keep_tk is not None:
    weights_tk = jnp.where(keep_tk, weights_tk, 0)
  combine_tx = jnp.sum(jax.nn.one_hot(ids_tk, router_dx.shape[1]) * weights_tk[..., None], -2)
  gate_txf = jnp.einsum("td,xdf->txf", x_td, w_gate_xdf)
  up_txf = jnp.einsum("td,xdf->txf", x_td, w_up_xdf)
  out_txd = jnp.einsum("txf,xfd->txd", jax.nn.silu(gate_txf) * up_txf, w_down_xfd)
  return jnp.einsum("txd,tx->td", out_txd, combine_tx), ids_tk


def _value_and_grads(fn, params, cot_td):
  """(out, ids, stats) and the gradients of sum(out * cot) w.r.t. all five arrays."""

  def loss(*params):
    out_td, *aux = fn(*params)
    return jnp.sum(out_td * cot_td), (out_td, *aux)

  with jax.default_matmul_precision("highest"):
    grad_fn = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True))
    grads, aux = grad_fn(*params)
  return aux, grads


def _assert_close(actual, expected, err_msg=""):
  # float32 at HIGHEST precision, summed in another order (per device, then over devices): the
  # longest sums are the weight gradients' over all tokens.
  tolerance.assert_close(actual, expected, n=TOKENS, err_msg=err_msg)


def _assert_matches(ep_fn, ref_fn, params, rng):
  cot_td = jnp.asarray(rng.normal(size=params[0].shape), jnp.float32)
  (out, ids, stats), grads = _value_and_grads(ep_fn, params, cot_td)
  (ref_out, ref_ids), ref_grads = _value_and_grads(ref_fn, params, cot_td)
  np.testing.assert_array_equal(ids, ref_ids)
  _assert_close(out, ref_out)
  for name, grad, ref_grad in zip(
    ["x", "router", "gate", "up", "down"], grads, ref_grads, strict=True
  ):
    assert np.abs(np.asarray(ref_grad)).max() > 0, name
    _assert_close(grad, ref_grad, err_msg=name)
  return out, ids, stats


def _check_loads(stats, ids_tk, placement, dropped=0):
  """expert_loads is the bincount of the routes; the slots of an expert serve all its kept
  assignments, and only slots that hold an expert serve any."""
  loads_x = np.bincount(np.asarray(ids_tk).ravel(), minlength=X)
  np.testing.assert_array_equal(stats["expert_loads"], loads_x)
  assert int(stats["dropped"]) == dropped
  slot_loads = np.asarray(stats["slot_loads"])
  assert slot_loads.sum() == loads_x.sum() - dropped
  if placement is None:
    if dropped == 0:
      np.testing.assert_array_equal(slot_loads, loads_x)
    return
  slot_expert = np.asarray(placement.slot_expert_ds).ravel()
  assert slot_loads[slot_expert < 0].sum() == 0
  if dropped == 0:
    served_x = np.bincount(slot_expert[slot_expert >= 0], slot_loads[slot_expert >= 0], X)
    np.testing.assert_array_equal(served_x, loads_x)
    # Each of the 8 token shards splits its assignments of an expert by the shares, to within 1.
    share_xr, slot_xr = (
      np.asarray(placement.replica_share_xr),
      np.asarray(placement.replica_slot_xr),
    )
    for x in range(X):
      for slot, share in zip(slot_xr[x], share_xr[x], strict=True):
        if slot >= 0:
          assert abs(slot_loads[slot] - share * loads_x[x]) <= 8


# Every method on the expert axis of 4 (the other tests' size), and each other axis size with
# a placement; the rest of the cross product is `slow`.
_DENSE_CASES = [
  (e, method, (e, method) not in {(4, None), (4, "least_loaded"), (4, "replicate_pack"),
                                  (2, "replicate_pack"), (8, "least_loaded")})
  for e in (2, 4, 8)
  for method in (None, "least_loaded", "replicate_pack")
]  # fmt: skip


@pytest.mark.parametrize(
  "e,method",
  [pytest.param(e, m, marks=pytest.mark.slow) if slow else (e, m) for e, m, slow in _DENSE_CASES],
)
def test_matches_dense_reference(e, method):
  rng = _rng("dense", e, method)
  params = _params(rng)
  mesh = _mesh(e)
  placement = _placement(rng, e, method)
  ep = functools.partial(moe_expert_parallel, mesh=mesh, top_k=K, placement_layer=placement)
  _, ids, stats = _assert_matches(ep, _reference, params, rng)
  _check_loads(stats, ids, placement)
  per_device = TOKENS // 8 * K
  assert per_device <= int(stats["max_received"]) <= TOKENS * K


def _distinct_routes(rng, tokens, skew=0.0):
  """[tokens, K] distinct expert ids per token; `skew` > 0 favours low expert ids (Gumbel
  top-k over Zipf-like logits)."""
  scores_tx = rng.gumbel(size=(tokens, X)) - skew * np.log(np.arange(1, X + 1))
  return np.argsort(-scores_tx, axis=1)[:, :K].astype(np.int32)


@pytest.mark.parametrize("method", [None, "replicate_pack"])
def test_routing_replay(method):
  rng = _rng("replay", method)
  params = _params(rng)
  e = 4
  placement = _placement(rng, e, method)
  routes_tk = jnp.asarray(_distinct_routes(rng, TOKENS))
  ep = functools.partial(
    moe_expert_parallel,
    mesh=_mesh(e),
    top_k=K,
    placement_layer=placement,
    routes_tk=routes_tk,
  )
  ref = functools.partial(_reference, routes_tk=routes_tk)
  _, ids, stats = _assert_matches(ep, ref, params, rng)
  np.testing.assert_array_equal(ids, routes_tk)
  _check_loads(stats, routes_tk, placement)


@pytest.mark.parametrize("token_axes", [("data",), ("expert", "data"), None])
def test_token_layouts(token_axes):
  """Tokens over other axes, the expert axis put first, and a tensor axis that replicates."""
  rng = _rng("layouts", token_axes)
  params = _params(rng)
  mesh = make_mesh(jax.devices(), {"data": 2, "tensor": 2, "expert": 2})
  with jax.default_matmul_precision("highest"):
    out, ids, stats = jax.jit(
      functools.partial(moe_expert_parallel, mesh=mesh, top_k=K, token_axes=token_axes)
    )(*params)
    ref_out, ref_ids = _reference(*params)
  np.testing.assert_array_equal(ids, ref_ids)
  _assert_close(out, ref_out)
  _check_loads(stats, ids, None)


def test_bfloat16():
  """bf16 tokens and weights run in bf16 and stay near the float32 result."""
  rng = _rng("bf16")
  params = _params(rng)
  routes_tk = jnp.asarray(_distinct_routes(rng, TOKENS))  # no top-k flips from bf16 rounding
  ep = functools.partial(moe_expert_parallel, mesh=_mesh(4), top_k=K, routes_tk=routes_tk)
  with jax.default_matmul_precision("highest"):
    out, _, _ = jax.jit(ep)(*[p.astype(jnp.bfloat16) for p in params])
    ref_out, _ = _reference(*params, routes_tk=routes_tk)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 16.0])
def test_capacity_drops(capacity_factor):
  rng = _rng("capacity", capacity_factor)
  params = _params(rng)
  e = 4
  routes = _distinct_routes(rng, TOKENS, skew=2.0)
  keep_tk = moe_capacity.kept(routes, 8, X // e, e, capacity_factor)
  dropped = int((~keep_tk).sum())
  assert (dropped > 0) == (capacity_factor < 16)
  routes_tk = jnp.asarray(routes)
  ep = functools.partial(
    moe_expert_parallel,
    mesh=_mesh(e),
    top_k=K,
    routes_tk=routes_tk,
    config=ExpertParallelConfig(capacity_factor=capacity_factor),
  )
  ref = functools.partial(_reference, routes_tk=routes_tk, keep_tk=jnp.asarray(keep_tk))
  _, _, stats = _assert_matches(ep, ref, params, rng)
  _check_loads(stats, routes, None, dropped=dropped)
  kept_x = np.bincount(routes[keep_tk], minlength=X)
  np.testing.assert_array_equal(stats["slot_loads"], kept_x)


@pytest.mark.parametrize("method", [None, "replicate_pack"])
def test_invalid_rows_take_no_capacity_and_are_not_counted(method):
  """Padding rows (valid_t False) come before real tokens' second choices in the (k, token)
  order; they must not take the capacity those would get."""
  rng = _rng("valid", method)
  params = _params(rng)
  e, capacity_factor = 4, 1.0
  placement = _placement(rng, e, method)
  routes = _distinct_routes(rng, TOKENS, skew=2.0)
  valid_t = rng.random(TOKENS) < 0.6
  keep_tk = moe_capacity.kept(routes, 8, X // e, e, capacity_factor, valid_t)
  if method is None:  # with a placement, replicas hold more slots than the rule models
    assert int((~keep_tk & valid_t[:, None]).sum()) > 0
  ep = functools.partial(
    moe_expert_parallel,
    mesh=_mesh(e),
    top_k=K,
    routes_tk=jnp.asarray(routes),
    placement_layer=placement,
    valid_t=jnp.asarray(valid_t),
    config=ExpertParallelConfig(capacity_factor=capacity_factor),
  )
  with jax.default_matmul_precision("highest"):
    out, ids, stats = jax.jit(ep)(*params)
    if method is None:
      keep = jnp.asarray(keep_tk)
      ref_out, _ = _reference(*params, routes_tk=jnp.asarray(routes), keep_tk=keep)
      _assert_close(out, ref_out)
  np.testing.assert_array_equal(np.asarray(out)[~valid_t], 0)
  np.testing.assert_array_equal(ids, routes)
  assert int(stats["routed"]) == K * int(valid_t.sum())
  loads_x = np.bincount(routes[valid_t].ravel(), minlength=X)
  np.testing.assert_array_equal(stats["expert_loads"], loads_x)
  assert int(np.asarray(stats["slot_loads"]).sum()) == loads_x.sum() - int(stats["dropped"])
  if method is None:
    assert int(stats["dropped"]) == int((~keep_tk & valid_t[:, None]).sum())
  # All rows valid is the same as no mask.
  everything = jax.jit(functools.partial(ep, valid_t=jnp.ones(TOKENS, bool)))(*params)
  unmasked = jax.jit(functools.partial(ep, valid_t=None))(*params)
  _assert_close(everything[0], unmasked[0])
  for name in unmasked[2]:
    np.testing.assert_array_equal(everything[2][name], unmasked[2][name], err_msg=name)


def _emulated_ragged_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
  """ragged_all_to_all's documented semantics from all_gathers (XLA:CPU cannot run the real
  one): row r of the result is sender i's row in_off[i, me] + r - out_off[i, me] where
  out_off[i, me] <= r < out_off[i, me] + size[i, me], else `output`'s row."""
  del recv_sizes  # implied by the senders' sizes, which the sender side passes
  me = jax.lax.axis_index(axis_name)
  operand_i = jax.lax.all_gather(operand, axis_name)
  in_off_i = jax.lax.all_gather(input_offsets, axis_name)[:, me]
  size_i = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  out_off_i = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  row_r = jnp.arange(output.shape[0])
  result = output
  for i in range(operand_i.shape[0]):
    inside_r = (row_r >= out_off_i[i]) & (row_r < out_off_i[i] + size_i[i])
    src_r = jnp.clip(in_off_i[i] + row_r - out_off_i[i], 0, operand.shape[0] - 1)
    result = jnp.where(inside_r[:, None], operand_i[i][src_r], result)
  return result


def test_ragged_exchange_matches_reference(monkeypatch):
  """The offsets and sizes of the ragged path, run through an emulated collective."""
  monkeypatch.setattr(expert_module, "_ragged_all_to_all", _emulated_ragged_all_to_all)
  rng = _rng("ragged")
  params = _params(rng)
  e, capacity_factor = 4, 0.75
  placement = _placement(rng, e, "least_loaded")
  routes = _distinct_routes(rng, TOKENS, skew=2.0)
  routes_tk = jnp.asarray(routes)
  results = {}
  for exchange in ("all_to_all", "ragged_all_to_all"):
    config = ExpertParallelConfig(capacity_factor=capacity_factor, exchange=exchange)
    ep = functools.partial(
      moe_expert_parallel,
      mesh=_mesh(e),
      top_k=K,
      config=config,
      placement_layer=placement,
      routes_tk=routes_tk,
    )
    results[exchange] = _value_and_grads(ep, params, jnp.ones((TOKENS, D)))
  (out, _, stats), grads = results["ragged_all_to_all"]
  (ref_out, _, ref_stats), ref_grads = results["all_to_all"]
  assert int(stats["dropped"]) > 0
  _assert_close(out, ref_out)
  for grad, ref_grad in zip(grads, ref_grads, strict=True):
    _assert_close(grad, ref_grad)
  for name in ref_stats:
    np.testing.assert_array_equal(stats[name], ref_stats[name], err_msg=name)
  # Dropless through the ragged exchange equals the dense reference.
  ep = functools.partial(
    moe_expert_parallel,
    mesh=_mesh(e),
    top_k=K,
    config=ExpertParallelConfig(exchange="ragged_all_to_all"),
    placement_layer=placement,
  )
  with jax.default_matmul_precision("highest"):
    out, ids, _ = jax.jit(ep)(*params)
    ref_out, ref_ids = _reference(*params)
  np.testing.assert_array_equal(ids, ref_ids)
  _assert_close(out, ref_out)


def test_the_tpu_gmm_kernels_run_inside_the_layer(monkeypatch):
  """The Pallas TPU kernels (in interpret mode) inside the layer's shard_map, the weights cast
  to vary over the data axis: the same outputs and gradients as the dense reference. Their
  outputs must say which mesh axes they vary over, or shard_map refuses them. (The GPU
  kernels' interpreter cannot run under shard_map's checks in this jax: its dynamic_slice
  mixes varying and invariant operands. `test_ragged_exchange_lowers` lowers them.)"""
  monkeypatch.setattr(expert_module, "gmm", functools.partial(expert_module.gmm, interpret=True))
  rng = _rng("kernels")
  params = _params(rng, tokens=32)
  config = ExpertParallelConfig(gmm_impl="pallas_tpu")
  ep = functools.partial(moe_expert_parallel, mesh=_mesh(4), top_k=K, config=config)
  _assert_matches(ep, _reference, params, rng)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_exchange_lowers(platform):
  """Forward and backward lower to ragged-all-to-all for the accelerators (not runnable here),
  with the platform's gmm kernels inside the shard_map."""
  e = 4
  placement = _placement(_rng("lower"), e, "replicate_pack")
  gmm_impl = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
  config = ExpertParallelConfig(exchange="ragged_all_to_all", gmm_impl=gmm_impl)
  ep = functools.partial(
    moe_expert_parallel, mesh=_mesh(e), top_k=K, config=config, placement_layer=placement
  )

  def loss(*params):
    return jnp.sum(ep(*params)[0])

  shapes = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in _params(_rng("lower"))]
  exported = jax.export.export(
    jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)))),
    platforms=[platform],
    disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call(name)
      for name in ("ragged_all_to_all", lowering.TRITON_CALL)
    ],
  )(*shapes)
  text = exported.mlir_module()
  assert text.count("@ragged_all_to_all") == 4  # two exchanges forward, two backward
  # The experts' matmuls are the platform's kernel (the reference would be XLA's ragged_dot).
  kernel = {"tpu": "tpu_custom_call", "cuda": lowering.TRITON_CALL}[platform]
  assert f"@{kernel}" in text and "ragged_dot" not in text
  assert "all_to_all" in text.replace("ragged_all_to_all", "")  # the slots travel padded


def test_one_compile_for_two_placements():
  rng = _rng("compile")
  params = _params(rng)
  e = 4
  placements = [_placement(rng, e, "replicate_pack"), _placement(rng, e, "least_loaded")]
  assert not np.array_equal(placements[0].slot_expert_ds, placements[1].slot_expert_ds)
  traces = []

  @jax.jit
  def layer(params, placement):
    traces.append(1)
    return moe_expert_parallel(*params, mesh=_mesh(e), top_k=K, placement_layer=placement)

  with jax.default_matmul_precision("highest"):
    ref_out, _ = _reference(*params)
    for placement in placements:
      out, _, stats = layer(params, placement)
      _assert_close(out, ref_out)
      _check_loads(stats, route(params[0] @ params[1], K)[1], placement)
  assert len(traces) == 1
  assert layer._cache_size() == 1


def test_scan_over_layers_of_a_placement():
  """All layers as one PlacementLayer with a leading dim, scanned like the model's layers."""
  rng = _rng("scan")
  params = _params(rng)
  e = 2
  loads = (rng.pareto(1.0, (3, X)) * 100).round() + 1
  placement = placement_arrays(
    plan_placement(loads, num_devices=e, redundant_slots=1, method="replicate_pack"),
    max_replicas=e,
  )
  assert placement.slot_expert_ds.shape == (3, e, X // e + 1)

  def step(x_td, layer_placement):
    out, _, _ = moe_expert_parallel(
      x_td, *params[1:], mesh=_mesh(e), top_k=K, placement_layer=layer_placement
    )
    return out, None

  with jax.default_matmul_precision("highest"):
    out, _ = jax.jit(lambda x, p: jax.lax.scan(step, x, p))(params[0], placement)
    ref = params[0]
    for _ in range(3):
      ref = _reference(ref, *params[1:])[0]
  _assert_close(out, ref)


def test_bad_inputs():
  rng = _rng("bad")
  params = _params(rng)
  mesh = _mesh(4)
  call = functools.partial(moe_expert_parallel, mesh=mesh, top_k=K)
  no_expert = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  with pytest.raises(ValueError, match="no 'expert' axis"):
    moe_expert_parallel(*params, mesh=no_expert, top_k=K)
  with pytest.raises(ValueError, match="does not divide the 6 experts"):
    call(*_params(rng, experts=6))
  wrong_devices = _placement(rng, 2, "least_loaded")
  with pytest.raises(ValueError, match="placement is for 2 devices .* expert axis has 4"):
    call(*params, placement_layer=wrong_devices)
  with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, 8\]"):
    moe_expert_parallel(*params, mesh=mesh, top_k=9)
  with pytest.raises(ValueError, match="100 tokens do not split evenly over the 8 devices"):
    call(*_params(rng, tokens=100))
  with pytest.raises(ValueError, match="token_axes=.*must name distinct axes"):
    call(*params, token_axes=("batch",))
  duplicate = np.zeros((TOKENS, K), np.int32)
  with pytest.raises(ValueError, match="names an expert twice"):
    call(*params, routes_tk=jnp.asarray(duplicate))
  with pytest.raises(ValueError, match=r"routes_tk must be \[tokens=128, k=2\]"):
    call(*params, routes_tk=jnp.zeros((TOKENS, 3), jnp.int32))
  with pytest.raises(ValueError, match="w_up_xdf must be"):
    call(params[0], params[1], params[2], params[4], params[4])
  with pytest.raises(ValueError, match="max_replicas=1 is fewer"):
    placement_arrays(
      plan_placement(np.arange(1.0, 9)[None] ** 3, 4, 1, "replicate_pack"), 0, max_replicas=1
    )
  assert isinstance(_placement(rng, 4, "least_loaded"), PlacementLayer)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"capacity_factor": 0}, "capacity_factor must be None"),
    ({"capacity_factor": float("inf")}, "capacity_factor must be None"),
    ({"gmm_impl": "cuda"}, "gmm_impl must be one of"),
    ({"exchange": "ragged"}, "exchange must be one of"),
  ],
)
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ExpertParallelConfig(**kwargs)
