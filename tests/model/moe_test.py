"""The model's MoE layers on the expert-parallel path and the grouped dispatch (the same layer on
a one-device expert axis): same logits and gradients as the reference dispatch, with and
without a balancing placement, and routing replay on every path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grids, moe_capacity, tolerance

from jaxrl.model import ExpertParallel, Model, MoEInputs, get_preset
from jaxrl.model import moe as moe_module
from jaxrl.sharding import make_mesh, plan_placement
from jaxrl.sharding.expert import ExpertParallelConfig, placement_arrays

CFG = get_preset("tiny-moe", num_layers=2)  # 8 experts, top-2
# gpt-oss's MoE: router and expert biases, the clamped SwiGLU (clamped at 0.5, so that the
# clamps bind), attention sinks and biases.
OSS = get_preset(
  "tiny-moe", num_layers=2, moe_biases=True, mlp_activation="clamped_swiglu", swiglu_limit=0.5,
  attention_sinks=True, qkv_bias=True, attention_out_bias=True,
)  # fmt: skip
# Qwen2-MoE's: a shared expert behind a sigmoid gate beside the routed ones.
SHARED = get_preset(
  "tiny-moe", num_layers=2, shared_expert_dim=48, shared_expert_gate=True, qkv_bias=True
)
# The sums behind the loss and its gradients, float32 at HIGHEST precision, which the
# expert-parallel path adds in other orders (per device, then over devices).
LOSS_TERMS = tolerance.model_terms(CFG, tokens=3 * 7)
TERMS = tolerance.model_terms(CFG, backward=True, tokens=3 * 7)


def _params(model, rng):
  params = model.init(int(rng.integers(1 << 16)))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 16))), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  return jax.tree.unflatten(treedef, leaves)


# A gate or up projection this close to the clamped SwiGLU's limit (its kink, where the
# gradient jumps between 0 and 1) may fall on either side of it on two paths that round their
# sums differently: the gradients then differ by far more than rounding. Pre-activations of
# about 1 after sums of 128 float32 terms differ by about 1e-6 between the paths.
KINK_MARGIN = 1e-5


def _draw(model, rng, monkeypatch, tokens=(3, 7)):
  """Random params and tokens; with the clamped SwiGLU, drawn again while a gate (from the
  limit) or up projection (from +-limit) of any expert and token lies within `KINK_MARGIN` of
  the clamp in the reference forward (which computes every expert for every token, so this
  holds for any routes): about one draw in two for the gpt-oss config."""
  if model.config.mlp_activation != "clamped_swiglu":
    return _params(model, rng), jnp.asarray(rng.integers(0, CFG.vocab_size, tokens), jnp.int32)
  clamped, least = moe_module._clamped_swiglu, []

  def watched(gate, up, *, alpha, limit):
    margin = jnp.minimum(jnp.min(jnp.abs(gate - limit)), jnp.min(jnp.abs(jnp.abs(up) - limit)))
    jax.debug.callback(lambda m: least.append(float(m)), margin)
    return clamped(gate, up, alpha=alpha, limit=limit)

  with monkeypatch.context() as m, jax.default_matmul_precision("highest"):
    m.setattr(moe_module, "_clamped_swiglu", watched)
    forward = jax.jit(lambda p, t: model.apply(p, t)[0])
    for _ in range(50):
      params = _params(model, rng)
      tokens_bt = jnp.asarray(rng.integers(0, CFG.vocab_size, tokens), jnp.int32)
      least.clear()
      jax.block_until_ready(forward(params, tokens_bt))
      jax.effects_barrier()  # every layer's callback has run
      if min(least, default=float("inf")) > KINK_MARGIN:
        return params, tokens_bt
  raise AssertionError(f"50 draws put a pre-activation within {KINK_MARGIN} of the clamp")


def _loss_of_logits(logits_btv):
  return jnp.mean(jax.nn.log_softmax(logits_btv)[..., 0] * jnp.arange(logits_btv.shape[1]))


def _loss(model, moe):
  def f(params, tokens_bt):
    return _loss_of_logits(model.apply(params, tokens_bt, moe=moe)[0])

  return jax.jit(jax.value_and_grad(f))


def _assert_matches(loss, grads, want_loss, want_grads):
  tolerance.assert_close(loss, want_loss, n=LOSS_TERMS, err_msg="loss")
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
  ):
    tolerance.assert_close(g, w, n=TERMS, err_msg=jax.tree_util.keystr(path))


def _random_routes(rng, b, t, layers, k, experts):
  return (
    np.stack([rng.permutation(experts)[:k] for _ in range(b * t * layers)])
    .reshape(b, t, layers, k)
    .astype(np.int32)
  )


# Every axis size and placement is covered layer by layer in tests/sharding/expert_test.py.
@pytest.mark.parametrize(
  "experts_axis,placed,cfg",
  [(8, False, CFG), (4, True, CFG), (4, True, OSS), (8, False, SHARED)],
  ids=["home8", "placed4", "gpt-oss-placed4", "shared-expert-home8"],
)
def test_expert_parallel_model_matches_the_reference(experts_axis, placed, cfg, monkeypatch):
  rng = np.random.default_rng()
  model = Model(cfg)
  # 3 x 7 tokens do not divide the devices: the layer pads them.
  params, tokens_bt = _draw(model, rng, monkeypatch)
  mesh = make_mesh(jax.devices()[:8], {"data": 8 // experts_axis, "expert": experts_axis})
  placement = None
  if placed:
    loads_lx = rng.zipf(1.5, (CFG.num_layers, CFG.num_experts)).astype(np.float64)
    p = plan_placement(loads_lx, experts_axis, 1, "least_loaded")
    placement = placement_arrays(p, max_replicas=experts_axis)
  with jax.default_matmul_precision("highest"):
    want, want_grads = _loss(model, None)(params, tokens_bt)
    moe = MoEInputs(expert_parallel=ExpertParallel(mesh), placement=placement)
    got, got_grads = _loss(model, moe)(params, tokens_bt)
  _assert_matches(got, got_grads, want, want_grads)


def test_routing_replay_uses_the_given_routes_on_both_paths():
  rng = np.random.default_rng()
  model = Model(CFG)
  params = _params(model, rng)
  b, t = 2, 8
  tokens_bt = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
  routes = _random_routes(rng, b, t, CFG.num_layers, CFG.experts_per_token, CFG.num_experts)
  mesh = make_mesh(jax.devices()[:8], {"data": 2, "expert": 4})
  with jax.default_matmul_precision("highest"):
    logits, _, routed = jax.jit(model.apply, static_argnames="return_routing")(
      params, tokens_bt, return_routing=True
    )
    replay = MoEInputs(routes_btlk=jnp.asarray(routes))
    apply_replay = jax.jit(lambda p, x: model.apply(p, x, return_routing=True, moe=replay))
    _, _, replayed = apply_replay(params, tokens_bt)
    np.testing.assert_array_equal(replayed, routes)
    assert not np.array_equal(np.asarray(routed), routes)  # random routes differ from the router's
    want, want_grads = _loss(model, replay)(params, tokens_bt)
    ep = MoEInputs(expert_parallel=ExpertParallel(mesh), routes_btlk=jnp.asarray(routes))
    got, got_grads = _loss(model, ep)(params, tokens_bt)
    plain = _loss_of_logits(logits)  # the router's own routes
  # Replay changed the function: the loss moved by more than rounding could.
  assert abs(float(plain) - float(want)) > tolerance.atol(LOSS_TERMS, abs(float(want)))
  router_grads = [
    g for path, g in jax.tree_util.tree_leaves_with_path(got_grads) if "router" in str(path)
  ]
  assert router_grads and all(float(jnp.abs(g).max()) > 0 for g in router_grads)
  _assert_matches(got, got_grads, want, want_grads)


def test_a_placement_without_the_expert_parallel_path_is_refused():
  model = Model(CFG)
  p = plan_placement(np.ones((CFG.num_layers, CFG.num_experts)), 2, 1, "static")
  moe = MoEInputs(placement=placement_arrays(p))
  with pytest.raises(ValueError, match="expert-parallel path"):
    model.apply(model.init(0), jnp.zeros((1, 4), jnp.int32), moe=moe)


def test_expert_parallel_is_chosen_only_for_moe_models_on_an_expert_axis():
  mesh = make_mesh(jax.devices()[:8], {"data": 2, "expert": 4})
  flat = make_mesh(jax.devices()[:8], {"data": 8})
  assert ExpertParallel.for_mesh(CFG, mesh).spreads_experts
  assert ExpertParallel.for_mesh(CFG, flat) is None
  assert ExpertParallel.for_mesh(get_preset("tiny"), mesh) is None


def test_the_ragged_exchange_is_refused_on_an_expert_axis_of_cpu_devices():
  """XLA:CPU compiles a ragged all-to-all and fails when it runs: refused when the path is
  chosen, not at the first update."""
  ragged = ExpertParallelConfig(exchange="ragged_all_to_all")
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "expert": 2})
  with pytest.raises(ValueError, match=r"exchange='ragged_all_to_all' runs on TPU and GPU only"):
    ExpertParallel.for_mesh(CFG, mesh, ragged)
  # No exchange on a one-device expert axis (the grouped dispatch): nothing to refuse.
  grouped = dataclasses.replace(CFG, moe_dispatch="grouped")
  one = make_mesh(jax.devices()[:1], {})
  assert not ExpertParallel.for_mesh(grouped, one, ragged).spreads_experts


def test_the_grouped_dispatch_is_chosen_on_meshes_without_tensor_parallelism():
  grouped = dataclasses.replace(CFG, moe_dispatch="grouped")
  flat = make_mesh(jax.devices()[:8], {"data": 2, "fsdp": 4})
  one = ExpertParallel.for_mesh(grouped, make_mesh(jax.devices()[:1], {}))
  assert one is not None and not one.spreads_experts
  assert not ExpertParallel.for_mesh(grouped, flat).spreads_experts
  assert (
    ExpertParallel.for_mesh(grouped, make_mesh(jax.devices()[:8], {"data": 4, "tensor": 2})) is None
  )
  assert ExpertParallel.for_mesh(
    grouped, make_mesh(jax.devices()[:8], {"expert": 8})
  ).spreads_experts
  assert (
    ExpertParallel.for_mesh(dataclasses.replace(get_preset("tiny"), moe_dispatch="grouped"), flat)
    is None
  )
  with pytest.raises(ValueError, match="moe_dispatch must be one of"):
    dataclasses.replace(CFG, moe_dispatch="sorted")


# The grouped dispatch is the expert-parallel layer on a one-device expert axis: the tokens
# split over the data and fsdp axes (3 x 7 do not divide 8: the layer pads them), every device
# running all experts with `gmm`. The models differ in their experts' maths, the meshes in how
# tokens are split and padded: by default each model runs on one mesh (`-m slow`: all six).
@pytest.mark.parametrize(
  "cfg,axes",
  grids.covering(
    {"tiny-moe": CFG, "gpt-oss": OSS, "shared-expert": SHARED},
    {"one-device": {}, "fsdp4-data2": {"data": 2, "fsdp": 4}},
  ),
)
def test_the_grouped_dispatch_matches_the_reference(cfg, axes, monkeypatch):
  rng = np.random.default_rng()
  model = Model(cfg)
  params, tokens_bt = _draw(model, rng, monkeypatch)
  devices = jax.devices()[: max(1, int(np.prod(list(axes.values()))))]
  mesh = make_mesh(devices, axes)
  grouped = ExpertParallel.for_mesh(dataclasses.replace(cfg, moe_dispatch="grouped"), mesh)
  assert grouped is not None
  routes = _random_routes(rng, 3, 7, cfg.num_layers, cfg.experts_per_token, cfg.num_experts)
  with jax.default_matmul_precision("highest"):
    for replay in (None, jnp.asarray(routes)):
      want, want_grads = _loss(model, MoEInputs(routes_btlk=replay))(params, tokens_bt)
      got, got_grads = _loss(model, MoEInputs(grouped, routes_btlk=replay))(params, tokens_bt)
      _assert_matches(got, got_grads, want, want_grads)


# -- capacity: padding takes none, drops are counted ---------------------------------------------


def _capacity_inputs(mesh, routes=None, valid_bt=None):
  config = ExpertParallelConfig(capacity_factor=1.0)
  return MoEInputs(
    expert_parallel=ExpertParallel(mesh, config),
    routes_btlk=None if routes is None else jnp.asarray(routes),
    valid_bt=None if valid_bt is None else jnp.asarray(valid_bt),
  )


def test_right_padding_changes_no_real_tokens_logits_or_drops_under_a_capacity():
  """8 rows on 8 devices (one row each): the same rows with 5 more padding positions give the
  real positions the same logits and drop the same assignments."""
  rng = np.random.default_rng()
  model = Model(CFG)
  params = _params(model, rng)
  mesh = make_mesh(jax.devices()[:8], {"data": 2, "expert": 4})
  lengths = rng.integers(3, 9, 8)
  valid_bt = np.arange(8) < lengths[:, None]
  tokens_bt = rng.integers(0, CFG.vocab_size, (8, 8)) * valid_bt
  padded_bt = np.pad(tokens_bt, ((0, 0), (0, 5)))

  @jax.jit
  def apply(params, tokens_bt, valid_bt):
    moe = _capacity_inputs(mesh, valid_bt=valid_bt)
    return model.apply(params, tokens_bt, moe=moe, return_moe_counts=True)

  with jax.default_matmul_precision("highest"):
    logits, _, counts = apply(params, tokens_bt, valid_bt)
    padded, _, padded_counts = apply(params, padded_bt, np.pad(valid_bt, ((0, 0), (0, 5))))
  assert int(counts["routed"]) == int(valid_bt.sum()) * CFG.experts_per_token * CFG.num_layers
  assert int(counts["dropped"]) > 0, "the test wants drops at capacity factor 1"
  assert {k: int(v) for k, v in padded_counts.items()} == {k: int(v) for k, v in counts.items()}
  tolerance.assert_close(np.asarray(padded)[:, :8][valid_bt], logits[valid_bt], n=LOSS_TERMS)


def test_rows_the_layer_pads_take_no_capacity_and_drops_are_counted():
  """4 x 15 tokens over 8 token shards of 8: the layer pads 4 rows onto the last shard, beside 4
  real ones, and their first choices come before the real tokens' second choices there."""
  rng = np.random.default_rng(0)  # a draw where counting the padding drops other assignments
  model = Model(CFG)
  params = _params(model, rng)
  mesh = make_mesh(jax.devices()[:8], {"data": 2, "expert": 4})
  b, t, k, layers, pad = 4, 15, CFG.experts_per_token, CFG.num_layers, 4
  # Skewed routes (low experts favoured, as the padding's are), so that a capacity factor of 1
  # drops some.
  scores = rng.gumbel(size=(b * t * layers, CFG.num_experts)) - 2 * np.log(
    np.arange(1, CFG.num_experts + 1)
  )
  routes = np.argsort(-scores, axis=1)[:, :k].reshape(b, t, layers, k).astype(np.int32)
  tokens_bt = rng.integers(0, CFG.vocab_size, (b, t))
  moe = _capacity_inputs(mesh, routes)
  apply = jax.jit(lambda p, x: model.apply(p, x, moe=moe, return_moe_counts=True))
  _, _, counts = apply(params, tokens_bt)
  valid_t = np.arange(b * t + pad) < b * t
  want = naive = 0
  for layer in range(layers):
    routes_tk = routes[:, :, layer].reshape(b * t, k)
    spread = (np.arange(pad)[:, None] + np.arange(k)) % CFG.num_experts  # the layer's padding
    padded_tk = np.concatenate([routes_tk, spread])
    slots = CFG.num_experts // 4
    want += int((~moe_capacity.kept(padded_tk, 8, slots, 4, 1.0, valid_t))[valid_t].sum())
    naive += int((~moe_capacity.kept(padded_tk, 8, slots, 4, 1.0))[valid_t].sum())
  assert want > 0 and naive != want, "the test wants drops that padding would change"
  assert int(counts["routed"]) == b * t * k * layers
  assert int(counts["dropped"]) == want
