"""`use_compile_cache`: a second process loads what the first compiled; a directory JAX already
has is kept; "" leaves JAX alone; a directory that cannot be written is a config error, the
default one a warning.

Each case runs in a fresh process without the suite's own cache (`tests/conftest.py` gives
every test process one through JAX_COMPILATION_CACHE_DIR, which `use_compile_cache` keeps)."""

import json
import os
import subprocess
import sys

from jaxrl.compile_cache import use_compile_cache
from jaxrl.config import DEFAULT_COMPILE_CACHE_DIR

_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from jaxrl.config import ConfigError
from jaxrl.compile_cache import use_compile_cache
from jaxrl.config import DEFAULT_COMPILE_CACHE_DIR

events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
try:
  used = use_compile_cache(sys.argv[1])
except ConfigError as e:
  print(json.dumps({"error": str(e)}))
  sys.exit(0)
x = jnp.arange(64.0).reshape(8, 8)
value = float(jax.jit(lambda a: jnp.tanh(a @ a.T).sum())(x))
print(json.dumps({
  "used": used,
  "jax_dir": jax.config.jax_compilation_cache_dir,
  "value": value,
  "hits": events.count("/jax/compilation_cache/cache_hits"),
  "misses": events.count("/jax/compilation_cache/cache_misses"),
}))
"""


def _run(directory: str, **env) -> dict:
  environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  # Whatever this CPU's compile time, the test's one program is stored.
  environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu", **env)
  done = subprocess.run(
    [sys.executable, "-c", _PROGRAM, directory],
    env=environ,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  cache = tmp_path / "home" / "xla"  # not there yet: created
  first = _run(str(cache))
  assert first["used"] == first["jax_dir"] == str(cache)
  assert first["hits"] == 0 and first["misses"] >= 1
  assert any(cache.iterdir())
  second = _run(str(cache))
  assert second["hits"] >= 1 and second["misses"] == 0
  assert second["value"] == first["value"]


def test_a_directory_the_environment_gives_jax_wins(tmp_path):
  given, ours = tmp_path / "given", tmp_path / "ours"
  given.mkdir()
  got = _run(str(ours), JAX_COMPILATION_CACHE_DIR=str(given))
  assert got["used"] == got["jax_dir"] == str(given)
  assert not ours.exists() and any(given.iterdir())


def test_empty_leaves_jax_without_a_cache(tmp_path):
  got = _run("")
  assert got["used"] is None and not got["jax_dir"]
  assert got["hits"] == got["misses"] == 0


def test_an_unwritable_directory_is_a_config_error(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  got = _run(str(blocker / "xla"))
  assert "config.compile_cache_dir" in got["error"] and "''" in got["error"]


def test_an_unwritable_default_warns_and_runs_without_a_cache(tmp_path):
  not_a_home = tmp_path / "a_file"
  not_a_home.write_text("HOME points here")
  got = _run(DEFAULT_COMPILE_CACHE_DIR, HOME=str(not_a_home))
  assert got["used"] is None and not got["jax_dir"] and got["hits"] == got["misses"] == 0
  assert "No persistent compilation cache" in got["stderr"]
  assert "config.compile_cache_dir" in got["stderr"]


def test_this_process_keeps_the_suites_cache():
  suites = os.environ["JAX_COMPILATION_CACHE_DIR"]  # tests/conftest.py's, or the user's
  assert use_compile_cache("/nonexistent/never/created") == suites
  assert not os.path.exists("/nonexistent/never/created")
