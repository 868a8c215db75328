"""Where a test run's time goes: each test phase's seconds tracing, lowering, compiling and
collecting garbage, written while the tests run and summed after.

    JAXRL_TEST_COMPILE_PROFILE=<folder> python -m pytest -q
    python tests/helpers/compile_profile.py <folder> [rows]

With the variable set, `tests/conftest.py` registers a `Recorder`: each test process appends
one JSON line per test phase (setup, call, teardown) to <folder>/<worker>.jsonl: its wall and
CPU seconds, the seconds Python's garbage collector ran, the seconds JAX spent tracing,
lowering to MLIR and compiling (persistent-cache reads included), its persistent-cache hits,
and each compiled function's name, seconds and persistent-cache key (the program's identity:
its MLIR, the compile options and the devices). Traces nest (a trace holds those of the
functions it calls) and programs compile on several threads, so those sums overlap. The
summary sums them by module and by compiled function, and counts the programs compiled more
than once in the run (in other workers, after a worker dropped its compiled programs, or too
quick to compile for the persistent cache to keep).
"""

import collections
import gc
import glob
import json
import logging
import os
import sys
import threading
import time

import jax
import pytest

try:
  from helpers import compiles
except ImportError:  # run as a script: its own folder is on sys.path, not tests/
  import compiles

_KINDS = ("trace", "lower", "compile", "gc")
_EVENTS = {
  compiles.TRACE_EVENT: "trace",
  compiles.LOWER_EVENT: "lower",
  compiles.BACKEND_COMPILE_EVENT: "compile",
}


_COMPILER_LOGGER = "jax._src.compiler"  # logs "... CACHE MISS for '<name>' with key '<key>'"


class _CacheMissHandler(logging.Handler):
  """Keeps the key of the last persistent-cache miss logged on each thread (`pending.key`)."""

  def __init__(self, pending: threading.local):
    super().__init__(logging.DEBUG)
    self.pending = pending

  def emit(self, record):
    if "CACHE MISS" in record.msg and len(record.args) == 2:
      self.pending.key = str(record.args[1])


class Recorder:
  """A pytest plugin writing each test phase's profile row to `folder` (one file per worker)."""

  def __init__(self, folder: str):
    self.folder = folder
    self.seconds = collections.Counter()
    self.compiled = []
    self.cache_hits = 0
    self._gc_started = 0.0
    # JAX logs each persistent-cache miss with the program's key on the thread that then
    # compiles it: the key waits there for that compile's duration event.
    self._pending_key = threading.local()
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    gc.callbacks.append(self._gc)
    compiler_log = logging.getLogger(_COMPILER_LOGGER)
    compiler_log.addHandler(_CacheMissHandler(self._pending_key))
    compiler_log.setLevel(min(compiler_log.getEffectiveLevel(), logging.DEBUG))

  def _duration(self, name, secs, fun_name="", **_):
    kind = _EVENTS.get(name)
    if kind is not None:
      self.seconds[kind] += secs
      if kind == "compile":
        key = getattr(self._pending_key, "key", "")
        self._pending_key.key = ""
        self.compiled.append([fun_name, round(secs, 3), key])

  def _event(self, name, **_):
    if name == compiles.CACHE_HIT_EVENT:
      self.cache_hits += 1

  def _gc(self, phase, _info):
    if phase == "start":
      self._gc_started = time.perf_counter()
    else:
      self.seconds["gc"] += time.perf_counter() - self._gc_started

  def _phase(self, item, phase):
    self.seconds.clear()
    self.compiled.clear()
    self.cache_hits = 0
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    row = {
      "test": item.nodeid, "phase": phase, "wall": time.perf_counter() - wall,
      "cpu": time.process_time() - cpu, **{k: round(v, 4) for k, v in self.seconds.items()},
      "cache_hits": self.cache_hits, "compiled": list(self.compiled),
    }  # fmt: skip
    os.makedirs(self.folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(self.folder, f"{worker}.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_setup(self, item):
    yield from self._phase(item, "setup")

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_call(self, item):
    yield from self._phase(item, "call")

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_teardown(self, item, nextitem):
    yield from self._phase(item, "teardown")


def load(folder: str) -> list[dict]:
  rows = []
  for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
    with open(path) as f:
      rows.extend(json.loads(line) for line in f if line.strip())
  return rows


def summary(rows: list[dict], top: int = 25) -> str:
  total = collections.Counter()
  by_module = collections.defaultdict(collections.Counter)
  compiled = collections.Counter()
  compiled_seconds = collections.Counter()
  by_key = collections.defaultdict(list)  # cache key -> (name, seconds) of each compile
  for row in rows:
    module = row["test"].split("::")[0]
    for key in ("wall", "cpu", *_KINDS):
      total[key] += row.get(key, 0.0)
      by_module[module][key] += row.get(key, 0.0)
    by_module[module]["compiles"] += len(row["compiled"])
    total["compiles"] += len(row["compiled"])
    total["cache_hits"] += row.get("cache_hits", 0)
    for name, secs, *key in row["compiled"]:
      compiled[name] += 1
      compiled_seconds[name] += secs
      if key and key[0]:
        by_key[key[0]].append((name, secs))
  lines = [
    f"{len(rows)} test phases, {total['wall']:.0f} s wall, {total['cpu']:.0f} s CPU: "
    f"trace {total['trace']:.0f} s, lower {total['lower']:.0f} s, compile "
    f"{total['compile']:.0f} s ({total['compiles']:.0f} compiles, {total['cache_hits']:.0f} "
    f"from the persistent cache), garbage collection {total['gc']:.0f} s; traces nest and "
    "compiles on threads overlap",
    "",
    f"{'module':60} {'wall':>7} {'cpu':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'gc':>5} "
    f"{'n':>5}",
  ]
  for module, c in sorted(by_module.items(), key=lambda kv: -kv[1]["wall"])[:top]:
    lines.append(
      f"{module:60} {c['wall']:7.1f} {c['cpu']:7.1f} {c['trace']:6.1f} {c['lower']:6.1f} "
      f"{c['compile']:7.1f} {c['gc']:5.1f} {c['compiles']:5.0f}"
    )
  lines += ["", "functions by seconds compiling (compiles, seconds):"]
  lines += [
    f"{compiled[name]:6d} {secs:8.1f}  {name}" for name, secs in compiled_seconds.most_common(top)
  ]
  lines += _repeats(by_key, top)
  return "\n".join(lines)


def _repeats(by_key: dict, top: int) -> list[str]:
  """Lines on the programs (by persistent-cache key) compiled more than once in the run."""
  if not by_key:  # rows written before the profile kept keys
    return []
  again = {k: v for k, v in by_key.items() if len(v) > 1}
  extra = collections.Counter()  # function -> seconds of its compiles after the first
  count = collections.Counter()
  for compiles in again.values():
    name = compiles[0][0]
    extra[name] += sum(secs for _, secs in compiles[1:])
    count[name] += len(compiles) - 1
  lines = [
    "",
    f"programs compiled more than once: {len(again)} of {len(by_key)} keys, "
    f"{sum(count.values())} compiles again, {sum(extra.values()):.0f} s "
    "(compiles again, seconds):",
  ]
  lines += [f"{count[name]:6d} {secs:8.1f}  {name}" for name, secs in extra.most_common(top)]
  return lines


if __name__ == "__main__":
  if len(sys.argv) not in (2, 3):
    sys.exit(__doc__)
  rows = load(sys.argv[1])
  if not rows:
    sys.exit(f"No profile rows in {sys.argv[1]}: run pytest with JAXRL_TEST_COMPILE_PROFILE.")
  print(summary(rows, int(sys.argv[2]) if len(sys.argv) == 3 else 25))
