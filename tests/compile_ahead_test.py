"""`jaxrl.compile_ahead`: programs compiled on background threads, and their owner stopping them."""

import threading

import jax
import jax.numpy as jnp

from jaxrl.compile_ahead import compile_in_background


def test_programs_not_begun_when_the_owner_stops_are_skipped():
  """One thread, four programs: the owner stops while the second one lowers; it compiles, and
  the last two are never lowered (their futures end with None, not an error)."""
  stop, lowered = threading.Event(), []

  def lowering(n):
    def lower():
      lowered.append(n)
      if n == 1:
        stop.set()
      return jax.jit(lambda x: x * n).lower(jax.ShapeDtypeStruct((n + 1,), jnp.float32))

    return lower

  futures = compile_in_background([lowering(n) for n in range(4)], workers=1, stop=stop)
  assert [f.result(timeout=120) for f in futures] == [None] * 4
  assert lowered == [0, 1]


def test_without_a_stop_every_program_compiles():
  lowered = []

  def lowering(n):
    def lower():
      lowered.append(n)
      return jax.jit(lambda x: x + n).lower(jax.ShapeDtypeStruct((n + 1,), jnp.float32))

    return lower

  for future in compile_in_background([lowering(n) for n in range(3)], workers=2):
    future.result(timeout=120)
  assert sorted(lowered) == [0, 1, 2]
