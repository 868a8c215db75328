"""How far apart two float32 evaluations of the same sums may be, whatever the machine.

A kernel and its reference, a sharded and an unsharded run, micro-batches and the whole batch,
the expert-parallel layer and the dense one: they add the same terms in different orders, and
which order the compiler picks changes with the CPU model, the XLA version and the sharding. A
bare `atol=1e-6` that passes on one machine fails on another (one gradient element in 4096 off by
7.9e-6 on a fresh 2-core machine). What does not change is the size of the rounding error.

Each addition rounds its partial sum by at most u = 2**-24 (float32's unit roundoff) relative.
Over n additions whose rounding errors behave as independent, the error grows like sqrt(n), not
n: Higham and Mary, "A new approach to probabilistic rounding error analysis" (SIAM J. Sci.
Comput. 41(5), 2019), show that for any summation order

  |computed - exact| <= LAMBDA * sqrt(n) * u * S

fails with a probability that falls like n exp(-LAMBDA**2 / 2), where S is the sum of |terms|,
a bound on every partial sum. Two evaluations are each at most that far from the exact sum, and
each ends by rounding its result once more, hence the rule of `assert_close`:

  |actual - expected| <= k * (LAMBDA * sqrt(n) * u * scale + u * |expected|),

k = 2 evaluations, or 1 against an `exact` reference (float64, exact to float32's eyes).

`scale` is S element by element where the terms are at hand (|a| @ |b| for a matmul). For a
composite computation (a layer, a model's gradients) they are not, and the default is the largest
|expected| of the array: terms of random sign leave partial sums about the size of the results,
and taking the array's largest covers the elements whose terms cancel to near zero.

`n` counts the roundings behind an element: for one sum, its length; for a chain of sums, each
feeding the next (a model's layers, then its backward pass), their lengths added up, since the
errors of successive sums add like those of one longer sum. `model_terms` and `update_terms`
count them for the transformer and its optimizer step; `policy_loss_scale` gives the scale of a
policy loss, whose terms have either sign.

With LAMBDA = 8 the tolerance stays below 1e-4 of `scale` for n up to 10,000: a wrong sign, a
dropped term or a wrong index, which change results by a sizeable fraction of a term, still fail.
"""

import math

import jax
import numpy as np

UNIT_ROUNDOFF = 2.0**-24  # float32
LAMBDA = 8.0


def atol(n: int, scale, *, evaluations: int = 2) -> np.ndarray:
  """The absolute difference rounding can make between `evaluations` float32 evaluations (2, or
  1 against an exact value) of sums of `n` terms whose partial sums are at most `scale` (a
  number, or an array per element)."""
  if n < 1:
    raise ValueError(f"n is the number of terms of the longest reduction, >= 1; got {n}.")
  factor = evaluations * LAMBDA * math.sqrt(n) * UNIT_ROUNDOFF
  # Past this, float32 rounding could hide a real error: compare against float64 instead.
  if factor > 1e-3:
    raise ValueError(f"n={n} terms: rounding alone may reach {factor:.1g} of the scale.")
  return factor * np.asarray(scale, np.float64)


def assert_close(
  actual, expected, *, n: int, scale=None, exact: bool = False, err_msg: str = ""
) -> None:
  """Asserts that `actual` and `expected` differ by no more than float32 rounding allows.

  Args:
    actual: the result under test (any float dtype; compared in float64).
    expected: the reference result, of the same shape.
    n: roundings behind each element: the length of its sum (contraction length, tokens summed
      over, ...), or of a chain of sums added up (`model_terms`).
    scale: the size of the partial sums of those reductions: a number, or an array that
      broadcasts against `expected` (sum of |terms| per element where it is known). Default: the
      largest |expected|.
    exact: `expected` is exact (computed in float64): allow for `actual`'s rounding only.
    err_msg: prefixed to the failure message.
  """
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  evaluations = 1 if exact else 2
  if actual.shape != expected.shape:
    raise AssertionError(f"{err_msg} shapes differ: {actual.shape} vs {expected.shape}".strip())
  if scale is None:
    scale = np.max(np.abs(np.nan_to_num(expected, posinf=0.0, neginf=0.0)), initial=0.0)
  allowed = atol(n, scale, evaluations=evaluations)
  allowed = allowed + evaluations * UNIT_ROUNDOFF * np.abs(expected)
  diff = np.abs(actual - expected)
  # NaNs fail, except where both have one; equal infinities pass.
  ok = (diff <= allowed) | (actual == expected) | (np.isnan(actual) & np.isnan(expected))
  if ok.all():
    return
  allowed = np.broadcast_to(allowed, diff.shape)
  excess = np.where(ok, -np.inf, np.nan_to_num(diff / np.maximum(allowed, 1e-300), nan=np.inf))
  worst = np.unravel_index(np.argmax(excess), diff.shape)
  raise AssertionError(
    f"{err_msg} {np.count_nonzero(~ok)} of {ok.size} elements differ by more than float32 "
    f"rounding of {n}-term sums allows; worst at {tuple(int(i) for i in worst)}: actual "
    f"{actual[worst]!r}, expected {expected[worst]!r}, |difference| {diff[worst]:.3g} > allowed "
    f"{allowed[worst]:.3g}.".strip()
  )


def model_terms(cfg, *, backward: bool = False, tokens: int = 0) -> int:
  """`n` for results of the transformer of `cfg` (a ModelConfig): the sums along the longest
  path through it.

  Per block: the q/k/v projection (d_model terms), attention scores (head_dim) and weighted
  values (up to max_seq_len), the output projection (heads * head_dim), the MLP's or experts'
  input (d_model) and output (their hidden width) and the experts' combination (top-k); then the
  LM head (d_model) and the softmax (vocab). The backward pass goes the same way back, and a
  weight's gradient then sums over the `tokens` of the batch.
  """
  hidden = cfg.moe_mlp_dim if cfg.num_experts else cfg.mlp_dim
  top_k = cfg.experts_per_token if cfg.num_experts else 0
  block = 2 * cfg.d_model + cfg.head_dim + cfg.max_seq_len + cfg.num_heads * cfg.head_dim
  forward = cfg.num_layers * (block + hidden + top_k) + cfg.d_model + cfg.vocab_size
  return 2 * forward + tokens if backward else forward


def update_terms(cfg, params, tokens: int) -> int:
  """`n` for parameters after one optimizer update of the transformer of `cfg` on a batch of
  `tokens`: the forward and backward pass, then the global gradient norm of the clipping, a sum
  over every parameter."""
  size = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  return model_terms(cfg, backward=True, tokens=tokens) + size


def assert_same_update(got_params, want_params, params, *, n: int, updates: int = 1) -> None:
  """Two updates of the same `params` (pytrees) agree to within rounding.

  For steps proportional to the gradient (Adam with a large eps, whose first step is about
  lr * gradient): gradient rounding shows in the steps, so each leaf's scale is its largest step;
  the stored parameters add their own rounding (the `u |expected|` terms of `assert_close`),
  once per optimizer update: after `updates` of them, each run's parameters were rounded to
  float32 that many times, by up to u |p| each (two runs whose steps differ by rounding can
  round apart each time: a fuzzed learner's four updates, 2 ulps).
  """
  leaves = zip(
    jax.tree_util.tree_leaves_with_path(got_params),
    jax.tree.leaves(want_params),
    jax.tree.leaves(params),
    strict=True,
  )
  for (path, got), want, before in leaves:
    want64 = np.asarray(want, np.float64)
    scale = np.abs(want64 - np.asarray(before, np.float64)).max(initial=0.0)
    # The roundings of the updates before the last, as a scale: atol(n, this) is
    # 2 * (updates - 1) * u * |p|.
    scale = scale + (updates - 1) * np.abs(want64) / (LAMBDA * math.sqrt(n))
    err_msg = jax.tree_util.keystr(path)
    assert_close(got, want, n=n, scale=scale, err_msg=err_msg)


def policy_loss_scale(
  logp_bt,
  old_logp_bt,
  advantages_b,
  mask_bt,
  *,
  ref_logp_bt=None,
  kl_weight: float = 0.0,
  computed_logp: bool = False,
) -> float:
  """`scale` for a policy-gradient loss, a mean of -A * ratio terms (of either sign, so the loss
  can come out near 0) plus kl_weight * (exp(r) - r - 1), r = ref_logp - logp.

  The largest term's parts in absolute value, times 1 + |log-ratio| for the rounding of each
  ratio = exp(logp - old_logp) (and of r); with `computed_logp` (log-probs that a model computed
  in float32, not given inputs) also + |logp|, since they carry rounding of their own size.
  """
  mask = np.asarray(mask_bt) > 0
  # Padding may hold anything (even inf or NaN): only the masked-in tokens count.
  logp, old = (np.where(mask, np.asarray(x, np.float64), 0.0) for x in (logp_bt, old_logp_bt))
  terms = np.abs(np.asarray(advantages_b, np.float64))[:, None] * np.exp(logp - old)
  logs = np.abs(logp - old)
  if ref_logp_bt is not None and kl_weight:
    r = np.where(mask, np.asarray(ref_logp_bt, np.float64), 0.0) - logp
    terms = terms + kl_weight * (np.exp(r) + np.abs(r) + 1)
    logs = np.maximum(logs, np.abs(r))
  if computed_logp:
    logs = logs + np.abs(logp)
  return float(terms[mask].max(initial=0.0) * (1 + logs[mask].max(initial=0.0)))
