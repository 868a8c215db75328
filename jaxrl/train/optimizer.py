"""AdamW with global-norm gradient clipping and a warmup-then-decay learning-rate schedule."""

import dataclasses

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")
MU_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer settings.

  Attributes:
    learning_rate: peak learning rate, reached at the end of warmup.
    schedule: decay after warmup: `"constant"` (stay at the peak), `"cosine"` or `"linear"`
      (down to 0 at `total_steps`).
    warmup_steps: linear warmup from 0 to the peak over this many steps (0: start at the peak).
    total_steps: length of the run in optimizer steps; the decay ends here.
    weight_decay: AdamW's decoupled weight decay, applied to every parameter.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's denominator epsilon.
    max_grad_norm: gradients are scaled down to this global L2 norm; <= 0 disables clipping.
    mu_dtype: dtype of Adam's first moment, "float32" or "bfloat16". bf16 saves 2 bytes per
      parameter (1.1 GiB at 0.6B) at the cost of rounding the momentum to 8 bits of mantissa;
      the second moment, whose square root divides the step, stays fp32.
  """

  learning_rate: float = 1e-5
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 1000
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  mu_dtype: str = "float32"

  def __post_init__(self):
    if self.learning_rate < 0:
      raise ValueError(f"OptimizerConfig.learning_rate must be >= 0, got {self.learning_rate}.")
    if self.schedule not in SCHEDULES:
      raise ValueError(
        f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}."
      )
    if self.total_steps < 1:
      raise ValueError(f"OptimizerConfig.total_steps must be >= 1, got {self.total_steps}.")
    if not 0 <= self.warmup_steps <= self.total_steps:
      raise ValueError(
        f"OptimizerConfig.warmup_steps must be in [0, total_steps={self.total_steps}], "
        f"got {self.warmup_steps}."
      )
    if self.weight_decay < 0:
      raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}.")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)}.")
    if self.eps <= 0:
      raise ValueError(f"OptimizerConfig.eps must be > 0, got {self.eps}.")
    if self.mu_dtype not in MU_DTYPES:
      raise ValueError(
        f"OptimizerConfig.mu_dtype must be one of {MU_DTYPES}, got {self.mu_dtype!r}."
      )


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Learning rate per step: linear warmup from 0 to `cfg.learning_rate`, then `cfg.schedule`.

  Args:
    cfg: the optimizer config.

  Returns:
    A schedule mapping the step count (as the optimizer counts updates, from 0) to the rate.
    `cosine` and `linear` reach 0 at `cfg.total_steps` and stay there.
  """
  peak = cfg.learning_rate
  decay_steps = cfg.total_steps - cfg.warmup_steps
  if cfg.schedule == "constant":
    decay = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps=max(decay_steps, 1))
  else:
    decay = optax.linear_schedule(peak, 0.0, transition_steps=max(decay_steps, 1))
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, transition_steps=cfg.warmup_steps)
  return optax.join_schedules([warmup, decay], boundaries=[cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """AdamW on the schedule of `make_schedule`, after global-norm clipping of the gradients.

  Args:
    cfg: the optimizer config.

  Returns:
    `optax.chain(clip_by_global_norm(cfg.max_grad_norm), adamw(...))`, without the clipping when
    `cfg.max_grad_norm <= 0`.
  """
  adamw = optax.adamw(
    make_schedule(cfg),
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mu_dtype=jnp.dtype(cfg.mu_dtype),
  )
  if cfg.max_grad_norm <= 0:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
