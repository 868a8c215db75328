"""Programs compiled before their first call, on background threads: the learner's update
(`jaxrl.train.update_plan.compile_ahead`) and the rollout engine's shapes
(`jaxrl.rollout.precompile.compile_engine_ahead`).

A program lowered with `.lower(...)` on abstract arrays that carry the arguments' shapes,
dtypes and shardings, then compiled with `.compile()`, lands in the caches that a call of the
same jitted function on such arrays looks in: the call then compiles nothing. A call made
while a thread compiles its program waits for that compile: JAX compiles it once for both
(one compile event, on the thread; seen with jax 0.10.2). Nothing runs on a device. Tracing
holds Python's GIL; XLA's compiling, the long part, does not, so the threads compile while
the caller's thread runs other work.

`shared_function` lets jits made apart share those caches: engines built again in a process
with the same settings (a rollout worker restarted or added, a job's stages built again after a
fault) run the programs the first one traced and compiled; learners, their initialisation."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

COMPILE_AHEAD_THREADS = "jaxrl-compile"  # the prefix of the compiling threads' names


def abstract(tree):
  """Each array of `tree` as its shape, dtype and sharding (read now: the arrays may be
  donated later, while a thread still traces)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def with_shardings(shapes, shardings):
  """Abstract arrays (`jax.ShapeDtypeStruct`) of `shapes`, each with its sharding."""
  return jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    shapes,
    shardings,
  )


def compile_in_background(
  lowerings: Sequence[Callable[[], jax.stages.Lowered]],
  workers: int | None = None,
  stop: threading.Event | None = None,
) -> list[Future]:
  """Starts compiling each of `lowerings` (functions that trace and lower one program) on
  threads of their own (`workers` at most; default one a program); returns a future a
  program, done when it is compiled. Each runs in a copy of the caller's context, so traced
  settings (`jaxrl.kernels.common`) apply there too. Once `stop` is set, programs not begun
  are skipped (their futures end with None) and the threads end after the ones under way:
  an owner that stops does not leave threads compiling for minutes beside whatever the
  process runs next."""
  if not lowerings:
    return []
  pool = ThreadPoolExecutor(workers or len(lowerings), thread_name_prefix=COMPILE_AHEAD_THREADS)
  run = lambda f: contextvars.copy_context().run(_compile, f, stop)  # noqa: E731
  futures = [pool.submit(run, f) for f in lowerings]
  pool.shutdown(wait=False)  # its threads end with the last program
  return futures


def _compile(lower, stop: threading.Event | None = None) -> None:
  if stop is None or not stop.is_set():
    lower().compile()  # kept by JAX's caches, where the program's calls find it


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def shared_function(fun: Callable, *bound: Hashable) -> Callable:
  """`functools.partial(fun, *bound)`, one object in the process for each value of (`fun`,
  `bound`), for a caller to `jax.jit`.

  JAX keys its caches of traces, lowerings and executables on the function a jit wraps (by
  identity) and on the jit's settings and arguments (by value). A jit of a new closure or bound
  method traces, lowers and compiles its program again, so a learner or engine built a second
  time with the same settings did all three again (on a CPU, tracing and lowering a small
  model's programs take about as long as compiling them: 2-core VM, 2026-12-07, `tests/rl` with
  `tests/rollout`: 295 of 1,100 s of tracing, lowering and compiling were programs the process
  had made before). Jits of the function this returns share those caches.

  They share one cache of compiled shapes too: `_cache_size()` of any of them counts every
  shape compiled in the process for the function, not one owner's. An owner that reports its
  own compiled shapes counts them itself (`ShapeRecord`: the paged engine's `PagedCalls`, the
  learner's `compiled_shapes`).

  `fun` must be a module-level function (compared by identity) whose result depends only on
  `bound` and its traced arguments; `bound` holds hashable values compared by value (frozen
  dataclasses, model configs, meshes, shapes, dtypes).
  """
  key = (fun, bound)
  try:
    hash(key)
  except TypeError as e:
    raise TypeError(
      f"shared_function({getattr(fun, '__name__', fun)!r}): the values it binds must be "
      f"hashable (frozen dataclasses, tuples, meshes): {e}"
    ) from None
  with _SHARED_LOCK:
    shared = _SHARED.get(key)
    if shared is None:
      shared = _SHARED[key] = functools.partial(fun, *bound)
  return shared


class ShapeRecord:
  """The argument shapes each of one owner's programs ran on or was compiled ahead for: that
  owner's count of compiled shapes, where its programs are shared with others
  (`shared_function`) and JAX's own count is the process's. A shape is the arguments' tree
  structure with each leaf's shape and (canonical) dtype; the owner keeps each program's
  argument layouts fixed, so those are what select a compiled program, and it may leave out
  arguments whose shapes never change (`Counted`'s `fixed`). Thread-safe: programs
  compiled ahead are noted from their threads."""

  def __init__(self):
    self._met: dict[object, set] = {}
    self._lock = threading.Lock()

  def note(self, program, args) -> None:
    """Records that `program` runs (or was compiled ahead) on `args` (arrays, abstract arrays,
    numbers or None, in any tree)."""
    leaves, tree = jax.tree.flatten(args)
    key = (tree, *((np.shape(x), jax.dtypes.canonicalize_dtype(_dtype(x))) for x in leaves))
    with self._lock:
      self._met.setdefault(program, set()).add(key)

  def count(self, program=None) -> int:
    """Shapes noted for `program` (None: for every program)."""
    with self._lock:
      if program is None:
        return sum(map(len, self._met.values()))
      return len(self._met.get(program, ()))


def _dtype(x):
  dtype = getattr(x, "dtype", None)
  return np.result_type(x) if dtype is None else dtype


class Counted:
  """A jitted function whose calls and lowerings `record` notes, as `program`. The first
  `fixed` arguments (the weights, the optimizer state: hundreds of leaves whose shapes never
  change for the owner) are left out of the note, which is then a few leaves a call."""

  def __init__(self, jitted, record: ShapeRecord, program, fixed: int = 0):
    self.jitted, self._record, self._program, self._fixed = jitted, record, program, fixed

  def __call__(self, *args):
    self._record.note(self._program, args[self._fixed :])
    return self.jitted(*args)

  def lower(self, *args) -> jax.stages.Lowered:
    self._record.note(self._program, args[self._fixed :])
    return self.jitted.lower(*args)
