"""`ModelConfig.remat_policy`: what a rematerialised block keeps changes what the backward pass
recomputes, never the gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.packed_rows import two_packed_rows

from jaxrl.kernels.flash_attention import flash_attention
from jaxrl.model import Model, ModelConfig, get_preset

POLICIES = ("full", "save_attention", "save_dots")


def _cfg(**kw) -> ModelConfig:
  return get_preset("tiny", attention="flash", max_seq_len=48, **kw)


def _batch(cfg: ModelConfig):
  """Two packed rows: segments of 20, 11 and 17 tokens; the second row pads its last 17."""
  return two_packed_rows(cfg.vocab_size, (20, 11, 17), np.random.default_rng(0))


def _loss(model, params, batch):
  tokens, positions, segments = batch
  logits, _ = model.apply(params, tokens, positions, segment_ids_bt=segments)
  return jnp.sum(jnp.tanh(logits[..., :8]) * (segments[..., None] >= 0))


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (list, tuple)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


_REMAT = ("checkpoint", "remat2", "remat")


def _count_recomputed(jaxpr, predicate, *, inside=False) -> int:
  """Equations satisfying `predicate` inside a `jax.checkpoint` (what the backward pass runs
  again), in `jaxpr` and the jaxprs it holds."""
  total = 0
  for eqn in jaxpr.eqns:
    in_remat = inside or eqn.primitive.name in _REMAT
    total += in_remat and predicate(eqn)
    for sub in _sub_jaxprs(eqn):
      total += _count_recomputed(sub, predicate, inside=in_remat)
  return total


def _is_loop(eqn) -> bool:
  return eqn.primitive.name in ("scan", "while")


def _is_dot(eqn) -> bool:
  return eqn.primitive.name == "dot_general"


def _flash_loops(cfg: ModelConfig, segments) -> tuple[int, int]:
  """(loops of flash attention's forward, loops of its backward) at the model's shapes."""
  b, t = segments.shape
  q = jnp.zeros((b, t, cfg.num_heads, cfg.head_dim))
  kv = jnp.zeros((b, t, cfg.num_kv_heads, cfg.head_dim))

  def attention(q, k, v):
    return flash_attention(q, k, v, q_segment_ids=segments)

  def count(fn, *args):
    return _count_recomputed(jax.make_jaxpr(fn)(*args).jaxpr, _is_loop, inside=True)

  forward = count(attention, q, kv, kv)
  both = count(lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do), q, kv, kv, q)
  return forward, both - forward


@pytest.fixture(scope="module")
def plain_gradients():
  """The parameters, the batch and the gradients of the model without remat: computed once
  for every policy's test."""
  plain = Model(_cfg())
  params = plain.init(3)
  batch = _batch(plain.config)
  return params, batch, jax.jit(jax.grad(lambda p: _loss(plain, p, batch)))(params)


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_keep_the_gradients(policy, plain_gradients):
  """Every policy gives the gradients of the model without remat (fp32, packed rows)."""
  params, batch, want = plain_gradients
  remat = Model(_cfg(remat=True, remat_policy=policy))
  got = jax.jit(jax.grad(lambda p: _loss(remat, p, batch)))(params)
  terms = tolerance.model_terms(_cfg(), backward=True, tokens=96)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    scale = float(np.abs(np.asarray(w)).max()) + 1e-30
    tolerance.assert_close(g, w, n=terms, scale=scale)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_policies_change_what_the_backward_recomputes(scan_layers):
  """ "full" runs every layer's attention forward again in the backward pass; "save_attention"
  keeps its output and log-sum-exp instead (both are needed: without either the forward runs
  again); "save_dots" also keeps the projections, so fewer matmuls run again. Scanned, the
  program holds one block for all the layers; unrolled, one a layer."""
  cfg = _cfg(scan_layers=scan_layers)
  forward_loops, backward_loops = _flash_loops(cfg, _batch(cfg)[2])
  assert forward_loops > 0 and backward_loops > 0
  loops, dots = {}, {}
  for policy in POLICIES:
    model = Model(_cfg(remat=True, remat_policy=policy, scan_layers=scan_layers))
    params = model.init(0)
    batch = _batch(model.config)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, m=model, b=batch: _loss(m, p, b)))(params).jaxpr
    loops[policy] = _count_recomputed(jaxpr, _is_loop)
    dots[policy] = _count_recomputed(jaxpr, _is_dot)
  layers = 1 if scan_layers else cfg.num_layers
  assert cfg.num_layers > 1
  assert loops["full"] == layers * (forward_loops + backward_loops), loops
  assert loops["save_attention"] == layers * backward_loops, loops
  assert loops["save_dots"] == layers * backward_loops, loops
  assert dots["save_dots"] < dots["save_attention"] < dots["full"], dots


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(remat=True, remat_policy="offload"), "model.remat_policy must be one of"),
    (dict(remat_policy="save_attention"), "set model.remat=True"),
  ],
)
def test_policy_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(ModelConfig(), **bad)
