"""Test set-up: 8 simulated CPU devices before any JAX backend starts."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Shared test helpers (tiny Hugging Face checkpoints and tokenizers): `from helpers import ...`.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
  """Frees each test module's compiled executables when it ends: a suite that keeps them all
  runs out of memory maps for new ones (XLA:CPU then fails with "Cannot allocate memory")."""
  yield
  gc.collect()
  jax.clear_caches()
