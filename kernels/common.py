"""What every kernel's public function shares: the implementation names, the choice of one
from the platform of the inputs, and the checks of a block-sizes dataclass."""

import dataclasses

import jax

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}


def platform_of(x: jax.Array) -> str:
  """The platform of a concrete array's devices, else (under tracing) the default backend."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return next(iter(x.devices())).platform
  return jax.default_backend()


def resolve_impl(op: str, impl: str, interpret, x: jax.Array) -> str:
  """`impl` checked, with "auto" replaced by the kernel for `x`'s platform (the reference
  where there is none); `interpret` must name a kernel, since the reference has none."""
  if impl not in IMPLS:
    raise ValueError(f"Unknown {op} impl {impl!r}; expected one of {IMPLS}.")
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
  """Every field a positive int or None; `num_warps`, where there is one, a power of two."""
  name = type(block_sizes).__name__
  for field in dataclasses.fields(block_sizes):
    value = getattr(block_sizes, field.name)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}.{field.name} must be a positive int or None, got {value!r}.")
  warps = getattr(block_sizes, "num_warps", None)
  if warps is not None and warps & (warps - 1):
    raise ValueError(f"{name}.num_warps must be a power of two, got {warps}.")
