"""AdamW with global-norm gradient clipping and a warmup-then-decay learning-rate schedule; the
step that applies it unless the gradient is not finite, its state's layout, and XLA's options for
a training step."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")
MU_DTYPES = ("float32", "bfloat16")
GRAD_ACCUM_DTYPES = ("float32", "bfloat16")


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
    grad_accum_dtype: dtype of the gradient summed over a mini-batch's micro-batches, "float32"
      or "bfloat16". bf16 saves 2 bytes per parameter of the learner's peak (1.1 GiB at 0.6B):
      each micro-batch's gradient is computed in fp32 and added to the sum in fp32, and only the
      running sum is stored rounded to 8 bits of mantissa (a relative error of about 2^-9 per
      addition, against an update that Adam normalises anyway). The clipping norm squares and
      sums in fp32 (`global_norm`); the clipped gradient is bf16 and each Adam leaf promotes
      it to its moments' dtype.
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
  grad_accum_dtype: str = "float32"

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
    if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
      raise ValueError(
        f"OptimizerConfig.grad_accum_dtype must be one of {GRAD_ACCUM_DTYPES}, got "
        f"{self.grad_accum_dtype!r}."
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


# One transformation per config in a process: learners of equal configs then jit the same
# functions, and share their traces and programs (`compile_ahead.shared_function`).
@functools.cache
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
  return optax.chain(clip_by_global_norm(cfg.max_grad_norm), adamw)


def global_norm(tree) -> jax.Array:
  """The global L2 norm, every square and sum in float32. optax's squares and sums bf16 leaves
  in bf16 (0.1-0.3% off for bf16 gradient sums); the converts here fuse into the reductions,
  so no float32 copy of the gradients is made."""
  leaves = jax.tree.leaves(tree)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm` with the norm of `global_norm`; the same (empty) state.
  `update(..., grad_norm=n)` takes the gradients' norm computed already (`apply_if_finite`
  has it) instead of computing it again."""

  def update(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    norm = global_norm(updates) if grad_norm is None else grad_norm
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


_CPU_MEMORY_FIRST = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def training_compiler_options(mesh: jax.sharding.Mesh) -> dict[str, str] | None:
  """XLA options for a training step compiled for `mesh`'s devices.

  On CPU, XLA's default scheduler orders operations for concurrency, not memory: it runs every
  layer's rematerialisation ahead of the backward pass (XLA:CPU drops the optimization barrier
  that `jax.checkpoint` relies on) and every Adam leaf's intermediate ahead of the updates, so
  they are all live at once. Its memory-first scheduler planned a Qwen3-0.6B update (16 x 391
  tokens, micro-batches of 1) in 4.3 GiB of temporaries instead of 6.2 (`Learner.update_memory`).
  Accelerator backends schedule for memory already: None there, and None where this XLA does
  not know the option.
  """
  if mesh.devices.flat[0].platform != "cpu" or not _cpu_knows_memory_first():
    return None
  return dict(_CPU_MEMORY_FIRST)


@functools.cache
def _cpu_knows_memory_first() -> bool:
  try:
    jax.jit(lambda x: x + 1, compiler_options=_CPU_MEMORY_FIRST).lower(0).compile()
  except Exception:  # noqa: BLE001  (XLA raises its own error types for an unknown option)
    return False
  return True


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_shardings):
  """Shardings for `optimizer`'s state over `params`: each parameter-shaped part (Adam's
  moments) like its parameter, the rest (step counts) replicated on the parameters' mesh."""
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    jax.eval_shape(optimizer.init, params),
    param_shardings,
    transform_non_params=lambda _: replicated,
  )


def apply_if_finite(
  optimizer: optax.GradientTransformation, params, opt_state, grads, loss, metrics: dict
):
  """Applies the update unless loss or gradient is NaN/inf; returns (params, opt_state, metrics).

  A `lax.cond`, not a `where` over the new and old state: with the state donated, XLA keeps the
  old optimizer state alive beside the new one for a `where` (a copy of every Adam moment, 4.4
  GiB at 0.6B parameters, live through the whole update); the branches update it in place.
  """
  # Gradients summed in bf16 (`grad_accum_dtype`) go in as they are: the norm squares and sums
  # in fp32 (`global_norm`), and each Adam leaf promotes to its moments' and parameter's dtype
  # inside its own fused update; casting the whole tree first would hold an fp32 copy of every
  # gradient (2.2 GiB at 0.6B) beside the bf16 one.
  grad_norm = global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # The clipping gets this norm rather than computing its own inside the branch: XLA does not
  # share work across a conditional's boundary, so each gradient leaf was squared and summed
  # twice (on an H100, about 500 of the apply step's 1,338 kernels for Qwen3-0.6B).
  update = optax.with_extra_args_support(optimizer).update

  def step(params, opt_state, grads, grad_norm):
    updates, new_opt_state = update(grads, opt_state, params, grad_norm=grad_norm)
    return optax.apply_updates(params, updates), new_opt_state

  def keep(params, opt_state, grads, grad_norm):
    del grads, grad_norm
    return params, opt_state

  new_params, new_opt_state = jax.lax.cond(finite, step, keep, params, opt_state, grads, grad_norm)
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32))
  return new_params, new_opt_state, metrics
