"""Test set-up: 8 simulated CPU devices before any JAX backend starts, one compilation cache
for the whole test session, and XLA:CPU compiling at LLVM's cheapest settings."""

import collections
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `python -m pytest` puts the working directory first on sys.path. From the repository's root
# that makes the top-level `kernels/` folder (installed as `jaxrl.kernels`) importable as
# `kernels`, the name of Hugging Face's kernel package, which transformers 5.25 depends on and
# imports as its model classes load: transformers then fails with "cannot import name
# 'CUDAProperties' from 'kernels'". The tests import the installed package (`jaxrl.*`), so they
# see the root as its users do: not at all, however pytest was started.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]
# Shared test helpers (tiny Hugging Face checkpoints and tokenizers): `from helpers import ...`.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# One XLA compilation cache per test session, in a fresh directory: the RL tests build the same
# tiny learner and engines over and over (a new jit object per controller, and every module's
# executables are freed when it ends), so each of those programs compiles once per session
# instead of once per controller. The pytest process that creates the directory (xdist's
# controller, or the only process with `-n 0`) sets it in the environment before any worker or
# subprocess starts, so they all share it; it deletes it at the end. A directory given in
# JAX_COMPILATION_CACHE_DIR is used as it is and kept. A cold cache is what a test run starts
# with: nothing carries over from one run to the next.
_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _OWN_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Programs that compile in under 0.2 s are cheaper to compile again than to store.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  # A size bound turns on the cache's file lock, so that no process reads an entry another
  # process is still writing (pytest-xdist workers share the directory). Nothing is evicted.
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 << 30))

# Most of the suite's time is XLA:CPU compiling tiny programs, mostly in LLVM. Compiled with
# LLVM's cheapest settings they give the same results within every test's tolerance and the
# suite takes about a quarter less time (2-core VM, 2026-11-26: tests/train/learner_test.py
# 108 -> 74 s, tests/rl/async_test.py 167 -> 122 s). XLA:CPU's older elemental emitters
# instead of its MLIR fusion emitters halve what is left of compiling (2026-11-27, one process:
# tests/train/learner_test.py 123 -> 69 s, its compiles 91 -> 41 s); where this jaxlib does
# not know that flag (an unknown flag aborts the process) the suite goes on without it.
# Nor does LLVM split each program into parts to compile on several threads: for programs this
# small the split costs more than it saves, and the two test workers keep both cores busy
# anyway (2026-12-07, `tests/rollout/kv_park_test.py` in one process: CPU 55-59 s -> 50-51 s,
# wall 52-55 s -> 49 s; the split changes how a program compiles, not what it computes).
# Processes the tests start (the main job, Ray actors) inherit the flags. An optimisation
# level given in XLA_FLAGS is kept as it is, and GPU runs (JAX_PLATFORMS=cuda) compile as
# users do.
_CHEAP_LLVM = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
_ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"


def _xla_accepts(flags: str) -> bool:
  """Whether a JAX CPU backend starts with `flags` in XLA_FLAGS (checked in a child process:
  XLA ends the process that meets a flag it does not know)."""
  env = {**os.environ, "XLA_FLAGS": flags}
  probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
  try:
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0
  except subprocess.TimeoutExpired:
    return False


if _ON_CPU and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  _flags = f"{os.environ.get('XLA_FLAGS', '')} {_CHEAP_LLVM}".strip()
  # One probe when this jaxlib knows both flags (each probe starts a JAX backend: about 3 s).
  _optional = (_ELEMENTAL_EMITTERS, _ONE_CODEGEN_PART)
  if _xla_accepts(" ".join((_flags, *_optional))):
    _flags = " ".join((_flags, *_optional))
  else:
    for _flag in _optional:
      if _xla_accepts(f"{_flags} {_flag}"):
        _flags = f"{_flags} {_flag}"
  os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402

import pytest  # noqa: E402

# Python's cyclic garbage collector ran every 700 allocations, and tracing and lowering
# allocate millions of short-lived objects: it took 4.4 s of `tests/train/packing_test.py`'s
# 35 s (1,880 collections) and 7.4 s of `tests/rl/agent_test.py`'s 53 s. Collecting every
# 50,000 allocations, with everything the imports and the collection made frozen out of the
# collector's scans (`pytest_collection_finish`), it took 2.1 s there (2-core VM, 2026-12-07,
# one process). Memory is still freed: reference counting frees most objects at once, and the
# collector still runs, less often, on what is left.
_GC_THRESHOLDS = (50_000, 20, 20)
gc.set_threshold(*_GC_THRESHOLDS)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
  """Moves the objects alive once the tests are collected (modules, their constants, the
  tests' parameters) out of the collector's generations: they live as long as the run, and
  every full collection scanned them."""
  gc.collect()
  gc.freeze()


def pytest_unconfigure(config):
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Resident bytes just after the last drop: freed memory mostly stays with the process, so
# what counts is growth since then, not the total (which a drop barely lowers).
_resident_after_drop = 0


def _resident_and_maps() -> tuple[int, int, int] | None:
  """(resident bytes, memory maps, the kernel's limit on maps), or None where /proc cannot
  tell (not Linux)."""
  try:
    with open("/proc/self/statm") as f:
      resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps", "rb") as f:
      maps = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return resident, maps, int(f.read())
  except (OSError, ValueError):
    return None


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
  """Frees the compiled executables of the modules run so far when there are many: over a
  quarter of the kernel's memory maps (`vm.max_map_count`, 65,530 by default), or 1 GiB more
  resident than after the last drop (3 GiB before the first); always where /proc cannot tell.
  A suite that keeps them all runs out of memory maps for new ones (XLA:CPU then fails with
  "Cannot allocate memory"). Freeing them after every module instead cost the next modules
  their traces and compiles of the same small programs: on the 2-core VM (2026-12-06),
  `tests/model` with `tests/train` 427 -> 398 s (CPU 13m31s -> 12m36s), the suite 1,674 ->
  1,496 s (CPU 51m40s -> 45m51s); its workers peaked at 12,710 maps and 4.0 GB resident
  (before: 16,866 and 3.6 GB). (Those runs dropped whenever over 3 GiB resident, so once past
  it, after every module: a drop took one worker from 3.06 to 3.04 GiB.)"""
  global _resident_after_drop
  yield
  held = _resident_and_maps()
  if held is not None:
    resident, maps, max_maps = held
    if maps <= max_maps // 4 and resident <= max(3 << 30, _resident_after_drop + (1 << 30)):
      return
  gc.collect()
  jax.clear_caches()
  held = _resident_and_maps()
  _resident_after_drop = 0 if held is None else held[0]


# Each test module runs whole on one pytest-xdist worker (an xdist group of its own, unless it
# names one): its tests then share their traces, lowerings and module fixtures in one process.
# Spread test by test over both workers, each worker traced and lowered the module's programs
# (the persistent cache above shares compiled programs, not traces): on the 2-core VM
# (2026-12-07) `tests/rollout` took 324 s test by test, 285 s module by module (CPU 9m56s ->
# 9m02s). Groups go out longest first (`module_seconds.json`, a full run's seconds per module;
# one missing from it goes first), so that a run ends on short modules, not on a worker
# running a long one alone.
_MODULE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def _group_name(marker) -> str:
  return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names each test's group in its node id
def pytest_collection_modifyitems(config, items):
  if config.getoption("dist", None) != "loadgroup":
    return
  try:
    with open(_MODULE_SECONDS) as f:
      seconds = json.load(f)
  except (OSError, ValueError):
    seconds = {}
  modules_of = collections.defaultdict(set)
  groups = []  # each item's group, in collection order
  for item in items:
    module = item.nodeid.split("::")[0]
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
      item.add_marker(pytest.mark.xdist_group(module))
      groups.append(module)
    else:
      groups.append(_group_name(marker))
    modules_of[groups[-1]].add(module)
  weight = {
    group: sum(seconds.get(m, math.inf) for m in modules) for group, modules in modules_of.items()
  }
  # Every worker sorts alike (xdist stops a run whose workers collected different orders).
  order = sorted(range(len(items)), key=lambda i: (-weight[groups[i]], groups[i], i))
  items[:] = [items[i] for i in order]


_NOT_RUN = pytest.StashKey[str]()


def pytest_sessionfinish(session, exitstatus):
  """Fails the run when selected tests did not run (a crashed worker's remaining tests:
  pyproject.toml does not replace crashed workers); `pytest_terminal_summary` says so."""
  config = session.config
  # An xdist worker, -x, or --collect-only (which runs nothing by design).
  if hasattr(config, "workerinput") or config.option.maxfail or config.option.collectonly:
    return
  reporter = config.pluginmanager.get_plugin("terminalreporter")
  if reporter is None:
    return
  ran = {
    report.nodeid
    for key, reports in reporter.stats.items()
    if key not in ("deselected", "warnings")
    for report in reports
    if getattr(report, "nodeid", None)
  }
  missing = session.testscollected - len(ran)
  if missing > 0:
    config.stash[_NOT_RUN] = (
      f"{missing} of {session.testscollected} selected tests did not run: a test worker "
      "crashed (see its failure) and crashed workers are not replaced "
      "(`--max-worker-restart=0` in pyproject.toml). Run the test it crashed on alone, then "
      "the suite again."
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  if _NOT_RUN in config.stash:
    terminalreporter.section("tests that did not run", red=True)
    terminalreporter.write_line(config.stash[_NOT_RUN], red=True)


# Where a test's time goes: with JAXRL_TEST_COMPILE_PROFILE=<folder>, each test process writes
# its tests' seconds tracing, lowering, compiling and collecting garbage to <folder>
# (`helpers/compile_profile.py` says what, and sums them).
def pytest_configure(config):
  folder = os.environ.get("JAXRL_TEST_COMPILE_PROFILE")
  if folder:
    from helpers import compile_profile

    config.pluginmanager.register(compile_profile.Recorder(folder), "jaxrl_compile_profile")
