"""Flash attention with a logit softcap (Gemma 2: logits s become c * tanh(s / c) before the
mask): the reference and both Pallas kernels in interpret mode against the float64 oracle of
`flash_attention_test` (output and gradients, through the tanh), on cases the cap changes far
past the tolerance; no tanh traced without a cap; an int cap. Bad caps:
`flash_attention_test.test_bad_inputs`; lowering: `flash_attention_lowering_test.py`.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, e head dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.kernels.flash_attention import reference

from .flash_attention_test import (  # noqa: TID252
  IMPLS,
  NAMES,
  WINDOW_BLOCKS,
  _assert_matches,
  _call,
  _make_inputs,
  _oracle,
  _outputs,
  _rng,
)

# (layout, t, s, window), float32, with a cap far inside the logits: packed rows (segments,
# padding) under a sliding window across blocks; a prefill chunk after cached keys of different
# lengths (q_len != kv_len, positions, padding), without a window. Blocks as WINDOW_BLOCKS.
SOFTCAP = 2.0
SOFTCAP_CASES = [("packed", 64, 64, 20), ("prefill", 24, 56, None)]


@functools.cache
def _softcap_case(case: int):
  """Inputs and oracle of SOFTCAP_CASES[case]: q and k scaled by 3 (logits sm q . k of
  standard deviation 9 with head_dim 16), so that most visible logits lie past twice the cap,
  where the tanh saturates (and its derivative is below 0.08)."""
  layout, t, s, window = SOFTCAP_CASES[case]
  b = 2 if layout == "prefill" else 1  # the prefill rows' caches differ
  (q, k, v), ids, cot = _make_inputs(
    _rng("softcap", case), b=b, t=t, s=s, h=2, k=1, e=16, dtype=jnp.float32, layout=layout
  )
  qkv = (3 * q, 3 * k, v)
  oracle = _oracle(qkv, ids, cot, sliding_window=window, logit_softcap=SOFTCAP)
  return qkv, ids, cot, oracle


@pytest.mark.parametrize("case", range(len(SOFTCAP_CASES)))
def test_softcap_cases_cap_most_logits_and_change_the_results(case):
  """The cases are ones a kernel that ignored the cap, in its forward or its backward, fails:
  most visible logits lie past twice the cap, and most elements of the capped oracle's output
  and gradients differ from the uncapped ones by over 100 times their tolerance."""
  *_, window = SOFTCAP_CASES[case]
  qkv, ids, cot, (want, scales, terms, _) = _softcap_case(case)
  plain, *_ = _oracle(qkv, ids, cot, sliding_window=window)
  q, k, _ = (np.asarray(x, np.float64) for x in qkv)
  q_seg, kv_seg, q_pos, kv_pos = (np.asarray(x) for x in ids)
  vis = reference.visible(
    q_seg[:, :, None], q_pos[:, :, None], kv_seg[:, None], kv_pos[:, None], causal=True,
    window=window,
  )  # fmt: skip
  logits = np.einsum("bthe,bse->bhts", q, k[:, :, 0]) * q.shape[-1] ** -0.5
  assert np.mean(np.abs(logits[np.broadcast_to(vis[:, None], logits.shape)]) > 2 * SOFTCAP) > 0.6
  for name in NAMES:
    allowed = tolerance.atol(terms[name], scales[name], evaluations=1)
    changed = np.abs(want[name] - plain[name])
    attended = changed > 0  # not a query that sees nothing or a key nobody sees
    assert np.mean(changed[attended] > 100 * allowed[attended]) > 0.6, name


@pytest.mark.parametrize("case", range(len(SOFTCAP_CASES)))
@pytest.mark.parametrize("impl", IMPLS)
def test_logit_softcap_matches_dense_oracle(impl, case):
  """Output and gradients (through the tanh) against the float64 oracle of the capped rule."""
  *_, window = SOFTCAP_CASES[case]
  qkv, ids, cot, oracle = _softcap_case(case)
  kwargs = {"impl": impl, "block_sizes": WINDOW_BLOCKS[impl], "sliding_window": window}
  if impl != "reference":
    kwargs["interpret"] = True
  got = _outputs(qkv, ids, cot, logit_softcap=SOFTCAP, **kwargs)
  _assert_matches(got, oracle[0], oracle, jnp.float32, exact=True)


def _primitives(jaxpr) -> set[str]:
  """The primitives of a jaxpr's equations and of every jaxpr inside them."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def _kernels(jaxpr) -> list:
  """The kernel jaxprs of the `pallas_call`s inside a jaxpr, in order."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn.params["jaxpr"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _kernels(sub)
  return found


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_none_traces_no_tanh(impl):
  """Without a cap no tanh is traced (the kernels are the uncapped ones); with one, a tanh is
  inside the forward's kernel and each backward kernel, or the reference's loops."""
  qkv, ids, cot = _make_inputs(
    _rng("tanh", impl), b=1, t=16, s=16, h=2, k=1, e=16, dtype=jnp.float32, layout="packed"
  )
  kwargs = {"impl": impl, **({} if impl == "reference" else {"interpret": True})}

  def grad_jaxpr(**cap):
    loss = lambda *qkv: jnp.sum(_call(qkv, ids, **kwargs, **cap) * cot)
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*qkv).jaxpr

  assert "tanh" not in _primitives(grad_jaxpr())
  assert "tanh" not in _primitives(grad_jaxpr(logit_softcap=None))
  capped = grad_jaxpr(logit_softcap=30)  # an int: taken as 30.0
  assert "tanh" in _primitives(capped)
  kernels = _kernels(capped)
  assert len(kernels) == (0 if impl == "reference" else 3)  # forward, dq, dk/dv
  assert all("tanh" in _primitives(kernel) for kernel in kernels)


def test_an_int_cap_is_the_float_cap():
  qkv, ids, _ = _make_inputs(
    _rng("int cap"), b=1, t=16, s=16, h=2, k=1, e=16, dtype=jnp.float32, layout="packed"
  )
  as_int = _call(qkv, ids, impl="reference", logit_softcap=1)
  np.testing.assert_array_equal(as_int, _call(qkv, ids, impl="reference", logit_softcap=1.0))
  assert np.abs(as_int - _call(qkv, ids, impl="reference")).max() > 0.1  # a cap that matters
