"""What every kernel's public function shares: the implementation names, the choice of one
from the platform of the inputs, and the checks of a block-sizes dataclass."""

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
  """`cap * tanh(logits / cap)`, Gemma 2's logit softcapping (attention logits, and the LM
  head's); `cap` None or 0 returns them as they are. Its derivative is `1 - (softcap(x) /
  cap) ** 2`."""
  return logits if not cap else cap * jnp.tanh(logits / cap)


_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}


_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  "target_platform", default=None
)


def check_sinks(sinks, num_heads: int) -> None:
  """Attention sinks (one logit per query head, `flash_attention` and `paged_attention`):
  None, or a float `[num_heads]` array."""
  if sinks is None:
    return
  shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
  if shape != (num_heads,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"sinks must be None or a float [num_q_heads={num_heads}] array (one logit per query "
      f"head), got {dtype or type(sinks).__name__}{shape or ''}."
    )


def output_like(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A `pallas_call` output of `shape` and `dtype` that varies over the mesh axes any of
  `inputs` varies over. Inside a `shard_map` (whose `check_vma` is on by default)
  `pallas_call` cannot infer that and refuses an output that does not say it: every GPU and
  TPU expert-parallel MoE layer did until 2026-11-29 (its `gmm` runs in one). Outside a
  `shard_map` the inputs vary over nothing and this is a plain `ShapeDtypeStruct`."""
  types = [jax.typeof(x).manual_axis_type for x in inputs]
  varying = frozenset().union(*(t.varying for t in types))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(types[0])(varying=varying))


@contextlib.contextmanager
def traced_setting(var: contextvars.ContextVar, value):
  """`var` set to `value` for the traces inside. jax's trace caches do not know such a
  setting, so entering and leaving clears them: a function traced under one value is not
  reused under another. The mechanism of `target_platform`, `auto_impls`,
  `paged_attention.default_block_sizes` and `flash_attention.pallas_gpu.mask_every_block`."""
  jax.clear_caches()
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)
    jax.clear_caches()


def target_platform(platform: str):
  """Traces inside choose the kernels of `platform` for `impl="auto"`: for compiling ahead of
  time for devices this process does not have (a GPU program compiled on a CPU machine,
  `launch/bench_kernels.py`), where neither the inputs nor the default backend say which
  (`traced_setting`)."""
  if platform not in _AUTO and platform != "cpu":
    known = [*sorted(_AUTO), "cpu"]
    raise ValueError(f"Unknown target platform {platform!r}; expected one of {known}.")
  return traced_setting(_TARGET_PLATFORM, platform)


_AUTO_OVERRIDES: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
  "auto_overrides", default=None
)


def auto_impls(**impl_by_op: str):
  """Traces inside resolve `impl="auto"` of the named kernels to the given impl, e.g.
  `auto_impls(qk_rope_write="reference")`: for timing a kernel against its reference inside
  the model that calls it (`bench.py decode_profile --reference`), where the call sites pass
  "auto" (`traced_setting`)."""
  for op, impl in impl_by_op.items():
    if impl not in IMPLS or impl == "auto":
      raise ValueError(f"auto_impls({op}={impl!r}): expected one of {IMPLS[1:]}.")
  return traced_setting(_AUTO_OVERRIDES, {**(_AUTO_OVERRIDES.get() or {}), **impl_by_op})


def platform_of(x: jax.Array) -> str:
  """The platform of a concrete array's devices, else (under tracing) the `target_platform`
  set around the trace, else the default backend."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return next(iter(x.devices())).platform
  return _TARGET_PLATFORM.get() or jax.default_backend()


def resolve_impl(op: str, impl: str, interpret, x: jax.Array) -> str:
  """`impl` checked, with "auto" replaced by the kernel for `x`'s platform (the reference
  where there is none); `interpret` must name a kernel, since the reference has none."""
  if impl not in IMPLS:
    raise ValueError(f"Unknown {op} impl {impl!r}; expected one of {IMPLS}.")
  overrides = _AUTO_OVERRIDES.get() or {}
  if impl == "auto" and op in overrides:
    impl = overrides[op]
  if impl == "auto":
    platform = platform_of(x)
    impl = _AUTO.get(platform, "reference")
    if interpret and impl == "reference":
      raise ValueError(
        f"interpret={interpret!r} with impl='auto' on platform {platform!r} would run the "
        "reference, not a kernel: name the kernel, impl='pallas_tpu' or impl='pallas_gpu'."
      )
  if interpret and impl == "reference":
    raise ValueError("interpret applies to the Pallas kernels, not to impl='reference'.")
  return impl


def check_block_fields(block_sizes) -> None:
  """Every field a positive int or None; `num_warps` and `num_warps_bwd`, where there are
  such fields, powers of two."""
  name = type(block_sizes).__name__
  for field in dataclasses.fields(block_sizes):
    value = getattr(block_sizes, field.name)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}.{field.name} must be a positive int or None, got {value!r}.")
  for field in ("num_warps", "num_warps_bwd"):
    warps = getattr(block_sizes, field, None)
    if warps is not None and warps & (warps - 1):
      raise ValueError(f"{name}.{field} must be a power of two, got {warps}.")
