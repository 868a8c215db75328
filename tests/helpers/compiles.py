"""Which functions XLA compiles inside a block: for tests that a step compiles nothing new."""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiled_functions():
  """Yields a list that gets the name of each function XLA compiles inside the block (e.g.
  "jit(_apply_impl)"), on any thread."""
  names = []

  def listener(event, _secs, fun_name="", **_):
    if event == BACKEND_COMPILE_EVENT:
      names.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
