"""JAX's persistent compilation cache for a run's processes: a program compiled once on a
machine is loaded, not compiled again, by the next process that meets it (a rerun, a run resumed
after a preemption, a restarted Ray worker or learner process), as long as its shapes, flags,
jax version and devices are the same.

The job (`jaxrl.rl.job.run`) and each Ray actor call `use_compile_cache` before they compile,
with `config.compile_cache_dir`. A cache directory given to JAX by the environment
(`JAX_COMPILATION_CACHE_DIR`) or by earlier code in the process wins over the config: it is
used as it is (the test suite's one-per-session cache stays the suite's).
"""

from __future__ import annotations

import logging
import os

import jax

from jaxrl.config import DEFAULT_COMPILE_CACHE_DIR, ConfigError

log = logging.getLogger(__name__)

# Programs that compile faster than this are cheaper to compile again than to store and load
# (JAX's own default is 1 s; most of a small model's programs compile in 0.2-1 s on a CPU).
MIN_COMPILE_SECONDS = 0.2
# Least recently used entries go past this many bytes. A bound also makes JAX lock the cache
# while it writes, so that processes sharing the directory (Ray actors on one node) never read
# a part-written entry.
MAX_BYTES = 16 << 30


def use_compile_cache(directory: str) -> str | None:
  """Turns on JAX's persistent compilation cache in `directory` (`~` expanded; created if
  missing) for this process, unless the environment or earlier code gave JAX one, which is
  kept. "" leaves JAX as it is. Returns the directory in use, or None.

  Raises:
    ConfigError: `directory` cannot be created or written, with what to change. Where it is
      the default (`DEFAULT_COMPILE_CACHE_DIR`), a warning instead, and no cache: a machine
      without a writable home directory still runs.
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if not directory:
    return None
  expanded = os.path.expanduser(directory)
  path = os.path.abspath(expanded)
  problem = _unwritable(path) if not expanded.startswith("~") else "no home directory for '~'"
  if problem and directory == DEFAULT_COMPILE_CACHE_DIR:
    log.warning(
      "No persistent compilation cache: %s. Every program compiles anew; set "
      "config.compile_cache_dir to a writable directory to keep them (or '' to say so).",
      problem,
    )
    return None
  if problem:
    raise ConfigError(
      f"config.compile_cache_dir={directory!r}: {problem}; give a directory this process can "
      "write, or '' to compile without a persistent cache."
    )
  # Settings the environment gives JAX (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS,
  # JAX_COMPILATION_CACHE_MAX_SIZE) are the user's: only unset ones get ours.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  jax.config.update("jax_compilation_cache_dir", path)
  # JAX decides whether a process uses the cache at its first compilation; one that compiled
  # before the directory was set would otherwise never use it.
  from jax.experimental.compilation_cache import compilation_cache

  compilation_cache.reset_cache()
  log.info("Compiled programs are cached in %s (config.compile_cache_dir).", path)
  return path


def _unwritable(path: str) -> str | None:
  """Why `path` cannot hold the cache (after creating it if missing); None if it can."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    return f"cannot create {path} ({e})"
  if not os.access(path, os.W_OK):
    return f"{path} is not writable"
  return None
