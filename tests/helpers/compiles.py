"""Which functions XLA compiles inside a block: for tests that a step compiles nothing new."""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def compiled_functions(event: str = BACKEND_COMPILE_EVENT):
  """Yields a list that gets the name of each function XLA compiles inside the block (e.g.
  "jit(apply)"), on any thread; with `event` (`TRACE_EVENT`), each one JAX traces."""
  names = []

  def listener(name, _secs, fun_name="", **_):
    if name == event:
      names.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
