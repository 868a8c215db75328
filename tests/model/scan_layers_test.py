"""`ModelConfig.scan_layers`: a pass without a cache runs its blocks as one `lax.scan` and gives
what the unrolled blocks give: logits, gradients, MoE routing and counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.packed_rows import two_packed_rows

from jaxrl.model import Model, get_preset


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_blocks_give_the_unrolled_results(preset, remat):
  cfg = get_preset(preset, num_layers=3, qk_norm=True, max_seq_len=24, remat=remat)
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
