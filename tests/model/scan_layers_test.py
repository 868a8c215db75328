"""`ModelConfig.scan_layers`: a pass without a cache runs its blocks as one `lax.scan` and gives
what the unrolled blocks give: logits, gradients, MoE routing and counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grids, tolerance
from helpers.packed_rows import two_packed_rows

from jaxrl.model import Model, PackedPrefillCache, get_preset

# "windowed": a window in the first and last of the 3 layers (the scan runs periods of 2
# blocks, then the last alone); unrolled and rematerialised, a block's window must stay a
# Python int inside `nnx.remat`.
WINDOWED = {"sliding_window": 5, "sliding_layers": (0, 2)}


# By default each preset runs once, windowed rematerialised (the case above); `-m slow` runs
# every preset both ways.
@pytest.mark.parametrize(
  "preset,remat",
  grids.covering(
    {"tiny": "tiny", "tiny-moe": "tiny-moe", "windowed": "windowed"},
    {"remat": True, "no-remat": False},
  ),
)
def test_scanned_blocks_give_the_unrolled_results(preset, remat):
  extra = WINDOWED if preset == "windowed" else {}
  preset = "tiny" if preset == "windowed" else preset
  cfg = get_preset(preset, num_layers=3, qk_norm=True, max_seq_len=24, remat=remat, **extra)
  scanned, unrolled = Model(cfg), Model(dataclasses.replace(cfg, scan_layers=False))
  rng = np.random.default_rng(0)
  params = scanned.init(1)
  # Segments of 9, 8 and 7 tokens; the second row pads its last 7.
  tokens, positions, segments = two_packed_rows(cfg.vocab_size, (9, 8, 7), rng)

  def run(model):
    def loss(p):
      logits, _, routes, counts = model.apply(
        p, tokens, positions, segment_ids_bt=segments, return_routing=True,
        return_moe_counts=True,
      )  # fmt: skip
      real = (segments >= 0)[..., None]
      return jnp.sum(jnp.tanh(logits[..., :8]) * real), (logits, routes, counts)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  with jax.default_matmul_precision("highest"):
    (got_loss, (got_logits, got_routes, got_counts)), got_grads = run(scanned)
    (want_loss, (want_logits, want_routes, want_counts)), want_grads = run(unrolled)
  n = tolerance.model_terms(cfg, backward=True, tokens=48)
  tolerance.assert_close(got_logits, want_logits, n=tolerance.model_terms(cfg))
  tolerance.assert_close(got_loss, want_loss, n=n, scale=48 * 8)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True
  ):
    scale = float(np.abs(np.asarray(w)).max()) + 1e-30
    tolerance.assert_close(g, w, n=n, scale=scale, err_msg=jax.tree_util.keystr(path))
  if cfg.is_moe:
    assert got_routes.shape == (2, 24, cfg.num_layers, cfg.experts_per_token)
    np.testing.assert_array_equal(got_routes, want_routes)
    assert int(got_counts["routed"]) == int(want_counts["routed"]) > 0
    assert int(got_counts["dropped"]) == int(want_counts["dropped"])
  else:
    assert got_routes is None and want_routes is None


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_the_program_holds_one_block_whose_weights_are_stacked_in_the_compute_dtype():
  """The scanned forward traces the block once (the dots of one block and the LM head, not one
  block a layer), and the weights it stacks are in the compute dtype (bf16 here, from fp32
  master weights): a copy half their size. A pass with a KV cache stays unrolled."""
  cfg = get_preset("tiny", num_layers=4, dtype="bfloat16", param_dtype="float32")
  tokens = jnp.zeros((1, 8), jnp.int32)

  def dots(model, *args):
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, *args)[0])(model.abstract_params())
    return sum(e.primitive.name == "dot_general" for e in _eqns(jaxpr.jaxpr)), jaxpr

  scanned = Model(cfg)
  scanned_dots, jaxpr = dots(scanned, tokens)
  unrolled_dots, _ = dots(Model(dataclasses.replace(cfg, scan_layers=False)), tokens)
  per_block = (unrolled_dots - 1) // cfg.num_layers  # less the LM head
  assert per_block > 0 and unrolled_dots == per_block * cfg.num_layers + 1
  assert scanned_dots == per_block + 1
  (scan,) = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
  stacked = scan.invars[scan.params["num_consts"] + scan.params["num_carry"] :]
  dtypes = {str(v.aval.dtype) for v in stacked if v.aval.shape[0] == cfg.num_layers}
  assert dtypes == {"int32", "bfloat16"}, dtypes  # the layer ids, then the weights
  cached_dots, _ = dots(scanned, tokens, None, scanned.init_cache(1, 8))
  assert cached_dots == unrolled_dots


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_scanned_packed_prefill_writes_the_pages_of_the_unrolled_one(preset):
  """A packed prefill scans its blocks too (its attention reads only the row's own keys) and
  writes each layer's keys and values to that layer's pool after the scan: the same pools
  and routes as unrolled, and padding tokens (position -1) write nothing."""
  cfg = get_preset(preset, num_layers=3, max_seq_len=24)
  scanned, unrolled = Model(cfg), Model(dataclasses.replace(cfg, scan_layers=False))
  rng = np.random.default_rng(2)
  params = scanned.init(3)
  tokens, positions, segments = two_packed_rows(cfg.vocab_size, (9, 8, 7), rng)
  positions = jnp.where(segments >= 0, positions, -1)  # the engine's padding
  page_size, num_pages = 4, 20
  # Each segment's tokens to pages of their own: segment s of row r from page 8 * r + 3 * s.
  pages_bt = 8 * jnp.arange(2)[:, None] + 3 * jnp.maximum(segments, 0) + positions // page_size
  pool = jnp.asarray(
    rng.normal(size=(cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)), jnp.float32
  )

  def prefill(model):
    cache = tuple(PackedPrefillCache(pool, pool + 1, pages_bt) for _ in range(cfg.num_layers))
    _, cache, routes = model.apply(
      params, tokens, positions, cache, return_routing=True, segment_ids_bt=segments
    )
    return cache, routes

  with jax.default_matmul_precision("highest"):
    got, got_routes = jax.jit(lambda: prefill(scanned))()
    want, want_routes = jax.jit(lambda: prefill(unrolled))()
  n = tolerance.model_terms(cfg)
  for layer, (g, w) in enumerate(zip(got, want, strict=True)):
    for name in ("k_pages_kpze", "v_pages_kpze"):
      tolerance.assert_close(getattr(g, name), getattr(w, name), n=n, err_msg=f"{layer} {name}")
  written = np.zeros((num_pages, page_size), bool)
  real = np.asarray(positions) >= 0
  written[np.asarray(pages_bt)[real], np.asarray(positions)[real] % page_size] = True
  np.testing.assert_array_equal(got[0].k_pages_kpze[:, ~written], pool[:, ~written])
  assert not np.allclose(got[0].k_pages_kpze[:, written], pool[:, written])
  if cfg.is_moe:
    np.testing.assert_array_equal(got_routes, want_routes)
