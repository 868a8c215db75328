"""Tests for jaxrl.train.optimizer.

Shape suffixes: d = parameter vector.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.train import optimizer

LR = 1e-3


def _cfg(**kwargs):
  return optimizer.OptimizerConfig(**{"learning_rate": LR, **kwargs})


@pytest.mark.parametrize(
  ("schedule", "expected"),
  [
    # warmup 10 steps 0 -> 1e-3, then 100 decay steps (total 110).
    ("constant", {0: 0.0, 5: 5e-4, 10: LR, 60: LR, 500: LR}),
    # linear: 1e-3 * (1 - (step - 10) / 100).
    ("linear", {0: 0.0, 5: 5e-4, 10: LR, 35: 7.5e-4, 60: 5e-4, 110: 0.0, 500: 0.0}),
    # cosine: 1e-3 * 0.5 * (1 + cos(pi * (step - 10) / 100)); step 35 -> 0.5 * (1 + cos(pi / 4)).
    (
      "cosine",
      {0: 0.0, 5: 5e-4, 10: LR, 35: LR * 0.5 * (1 + np.cos(np.pi / 4)), 60: 5e-4, 110: 0.0},
    ),
  ],
)
def test_schedule_values(schedule, expected):
  sched = optimizer.make_schedule(_cfg(schedule=schedule, warmup_steps=10, total_steps=110))
  for step, value in expected.items():
    np.testing.assert_allclose(sched(step), value, rtol=1e-5, atol=1e-10, err_msg=f"step {step}")


@pytest.mark.parametrize("schedule", optimizer.SCHEDULES)
def test_no_warmup_starts_at_peak(schedule):
  sched = optimizer.make_schedule(_cfg(schedule=schedule, warmup_steps=0, total_steps=100))
  np.testing.assert_allclose(sched(0), LR, rtol=1e-6)
  halfway = {"constant": LR, "linear": LR / 2, "cosine": LR / 2}[schedule]
  np.testing.assert_allclose(sched(50), halfway, rtol=1e-5)


def test_first_update_is_adamw_at_scheduled_rate():
  # On step 0, Adam's bias-corrected moments are g and g^2, so the update is
  # -lr * (g / (|g| + eps) + weight_decay * p).
  k1, k2 = jax.random.split(jax.random.key(0))
  params_d = jax.random.normal(k1, (7,))
  grads_d = jax.random.normal(k2, (7,)) * 0.1  # norm well below max_grad_norm: no clipping
  cfg = _cfg(weight_decay=0.1, eps=1e-3, max_grad_norm=10.0)
  opt = optimizer.make_optimizer(cfg)
  updates_d, _ = jax.jit(opt.update)(grads_d, opt.init(params_d), params_d)
  expected_d = -LR * (grads_d / (jnp.abs(grads_d) + 1e-3) + 0.1 * params_d)
  np.testing.assert_allclose(updates_d, expected_d, rtol=1e-5)


def test_bf16_first_moment_is_stored_in_bf16_and_updates_like_fp32():
  k1, k2 = jax.random.split(jax.random.key(1))
  params_d = jax.random.normal(k1, (64,))
  grads_d = jax.random.normal(k2, (64,)) * 0.1
  updates = {}
  for mu_dtype in ("float32", "bfloat16"):
    opt = optimizer.make_optimizer(_cfg(max_grad_norm=10.0, mu_dtype=mu_dtype))
    state = opt.init(params_d)
    mus = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (64,)]
    assert mus[0].dtype == jnp.dtype(mu_dtype) and mus[1].dtype == jnp.float32  # mu, nu
    for _ in range(3):
      updates[mu_dtype], state = jax.jit(opt.update)(grads_d, state, params_d)
  # The momentum rounded to bf16 (8 bits of mantissa) moves each update by at most ~2^-8.
  np.testing.assert_allclose(updates["bfloat16"], updates["float32"], rtol=2**-7, atol=1e-9)


def test_warmup_step_zero_does_not_move_params():
  params_d = jax.random.normal(jax.random.key(1), (5,))
  opt = optimizer.make_optimizer(_cfg(warmup_steps=4, weight_decay=0.1))
  state = opt.init(params_d)
  updates_d, state = opt.update(jnp.ones(5), state, params_d)
  np.testing.assert_array_equal(updates_d, 0.0)
  updates_d, _ = opt.update(jnp.ones(5), state, params_d)
  assert np.all(np.asarray(updates_d) < 0)  # step 1: lr = 1e-3 / 4


def test_clipping_bounds_the_update():
  # With eps much larger than |g|, Adam's first update is ~ -lr * g / eps, linear in g, so the
  # update's norm follows the (clipped) gradient norm: at most lr * max_grad_norm / eps.
  eps, max_norm = 100.0, 1.0
  grads = {
    "w": jax.random.normal(jax.random.key(2), (4, 3)) * 50.0,
    "b": jax.random.normal(jax.random.key(3), (3,)) * 50.0,
  }
  params = jax.tree.map(jnp.zeros_like, grads)
  assert float(optax.global_norm(grads)) > 100 * max_norm

  def first_update(cfg, g):
    opt = optimizer.make_optimizer(cfg)
    return opt.update(g, opt.init(params), params)[0]

  clipped = first_update(_cfg(eps=eps, max_grad_norm=max_norm), grads)
  unclipped = first_update(_cfg(eps=eps, max_grad_norm=0.0), grads)
  assert float(optax.global_norm(clipped)) <= LR * max_norm / eps * (1 + 1e-5)
  assert float(optax.global_norm(unclipped)) > 10 * LR * max_norm / eps
  # Clipping is exactly a rescale of the whole gradient tree to norm max_grad_norm.
  scale = max_norm / optax.global_norm(grads)
  rescaled = first_update(
    _cfg(eps=eps, max_grad_norm=0.0), jax.tree.map(lambda g: g * scale, grads)
  )
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), clipped, rescaled)


def test_bf16_gradient_norm_squares_and_sums_in_fp32():
  # Many bf16 leaves: squared and summed in bf16 (optax's norm) they miss the float64 norm by
  # about 1e-3; in fp32 by rounding only.
  rng = np.random.default_rng(0)
  leaves = [rng.normal(size=(64, 33)) * rng.uniform(0.1, 10) for _ in range(200)]
  grads = [jnp.asarray(x, jnp.bfloat16) for x in leaves]
  exact = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads))
  np.testing.assert_allclose(float(optimizer.global_norm(grads)), exact, rtol=1e-5)
  clip = optimizer.clip_by_global_norm(1.0)
  clipped, _ = clip.update(grads, clip.init(grads))
  assert all(c.dtype == jnp.bfloat16 for c in clipped)
  got = np.sqrt(sum(np.sum(np.asarray(c, np.float64) ** 2) for c in clipped))
  assert got == pytest.approx(1.0, rel=4e-3)  # each clipped value rounded to bf16 (2**-9)


def _equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside it (a conditional's branches, jits)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_apply_if_finite_reduces_each_gradient_once_and_updates_as_the_optimizer(max_grad_norm):
  """The finite check's norm is the one the clipping uses: each gradient leaf is squared and
  summed once in the whole step, its conditional included (the clipping computed its own
  inside the branch, where XLA cannot share it: twice). The update is the optimizer's own."""
  grads = {
    "w": jax.random.normal(jax.random.key(5), (4, 3)) * 50.0,
    "b": jax.random.normal(jax.random.key(6), (5,)) * 50.0,
  }
  params = jax.tree.map(lambda g: jnp.full(g.shape, 0.5), grads)
  opt = optimizer.make_optimizer(_cfg(max_grad_norm=max_grad_norm, weight_decay=0.1))
  state = opt.init(params)

  def step(p, s, g):
    return optimizer.apply_if_finite(opt, p, s, g, jnp.float32(0.0), {})

  jaxpr = jax.make_jaxpr(step)(params, state, grads).jaxpr
  shapes = {leaf.shape for leaf in jax.tree.leaves(grads)}
  reduced = [
    e.invars[0].aval.shape
    for e in _equations(jaxpr)
    if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape in shapes
  ]
  assert sorted(reduced) == sorted(shapes)  # once per leaf
  new_params, _, metrics = jax.jit(step)(params, state, grads)
  expected = optax.apply_updates(params, opt.update(grads, state, params)[0])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), new_params, expected
  )
  assert float(metrics["grad_norm"]) == pytest.approx(float(optimizer.global_norm(grads)))
  assert int(metrics["skipped"]) == 0


def test_small_gradients_are_not_clipped():
  grads_d = jax.random.normal(jax.random.key(4), (6,)) * 0.01
  params_d = jnp.zeros(6)

  def first_update(cfg):
    opt = optimizer.make_optimizer(cfg)
    return opt.update(grads_d, opt.init(params_d), params_d)[0]

  np.testing.assert_allclose(
    first_update(_cfg(eps=1.0, max_grad_norm=1.0)), first_update(_cfg(eps=1.0, max_grad_norm=0.0))
  )


@pytest.mark.parametrize(
  ("kwargs", "field"),
  [
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"schedule": "step"}, "schedule"),
    ({"total_steps": 0}, "total_steps"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2000}, "warmup_steps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"b1": 1.0}, "b1"),
    ({"b2": -0.5}, "b2"),
    ({"eps": 0.0}, "eps"),
    ({"mu_dtype": "float16"}, "mu_dtype"),
    ({"grad_accum_dtype": "int8"}, "grad_accum_dtype"),
  ],
)
def test_optimizer_config_validation(kwargs, field):
  with pytest.raises(ValueError, match=f"OptimizerConfig.{field}"):
    optimizer.OptimizerConfig(**kwargs)
