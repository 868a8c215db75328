"""The Pallas GPU kernels' timing A/B settings: traces under one build the kernels as they were
before an optimisation, for timing the two in one process (`launch/bench_attention.py`,
`benchmarks/flash_attention_tuning.py`), with the same results (to rounding). `pallas_gpu`
takes its exponential and its unmasked runs from here, and its users the settings
(`pallas_gpu.mask_every_block`, `pallas_gpu.natural_exp`)."""

import contextvars

import jax.numpy as jnp

from jaxrl.kernels.common import traced_setting
from jaxrl.kernels.flash_attention import reference

_LN2 = 0.6931471805599453

_MASK_EVERY_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "flash_attention_gpu_mask_every_block", default=False
)


def mask_every_block():
  """Traces inside mask every block pair, as the kernels did before they skipped the mask on
  pairs that see each other whole: for timing the two in one process
  (`launch/bench_attention.py`). Same results."""
  return traced_setting(_MASK_EVERY_BLOCK, True)


_NATURAL_EXP: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "flash_attention_gpu_natural_exp", default=False
)


def natural_exp():
  """Traces inside take the softmax's exponentials with `jnp.exp` (libdevice's accurate expf),
  as the kernels did before they worked in base 2: for timing the two in one process
  (`launch/bench_attention.py`). Same results to rounding."""
  return traced_setting(_NATURAL_EXP, True)


def exp2(x):
  """2**x: one ex2.approx a score; under `natural_exp`, libdevice's expf of x ln 2."""
  if _NATURAL_EXP.get():
    return jnp.exp(x * _LN2)
  return jnp.exp2(x)


def full_run(full_xy, lo_x, hi_x):
  """`reference.full_block_run`; under `mask_every_block`, an empty run."""
  if _MASK_EVERY_BLOCK.get():
    return hi_x, hi_x  # an empty run: every block visited with the mask
  return reference.full_block_run(full_xy, lo_x, hi_x)
