"""The test helpers that choose what a default run covers, and the compile profile's summary."""

import json
import logging
import threading

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_profile, grids


def _marked_slow(param) -> bool:
  return any(mark.name == "slow" for mark in param.marks)


def test_a_covering_grid_runs_every_value_of_every_axis_by_default_and_the_rest_when_slow():
  params = grids.covering({"a": 1, "b": 2, "c": 3}, {"x": "X", "y": "Y"})
  assert [p.id for p in params] == ["a-x", "a-y", "b-x", "b-y", "c-x", "c-y"]
  default = [p.values for p in params if not _marked_slow(p)]
  assert default == [(1, "X"), (2, "Y"), (3, "X")]
  assert len(params) - len(default) == 3  # the rest of the product, under -m slow
  assert {v[0] for v in default} == {1, 2, 3} and {v[1] for v in default} == {"X", "Y"}


def test_a_covering_grid_refuses_an_empty_axis():
  with pytest.raises(ValueError, match="every axis at least one value"):
    grids.covering({"a": 1}, {})


def test_the_compile_profile_sums_seconds_by_module_and_function(tmp_path):
  first = {"test": "tests/a_test.py::t1", "phase": "call", "wall": 3.0, "cpu": 2.5}
  first |= {"trace": 0.5, "lower": 0.25, "compile": 1.5, "cache_hits": 1}
  first["compiled"] = [["jit(f)", 1.0, "jit_f-1"], ["jit(g)", 0.5, "jit_g-1"]]
  second = {"test": "tests/a_test.py::t2", "phase": "setup", "wall": 1.0, "cpu": 1.0}
  second |= {"trace": 0.0, "lower": 0.0, "compile": 0.5, "cache_hits": 0}
  second["compiled"] = [["jit(f)", 0.5, "jit_f-1"]]  # the first program again
  rows = [first, second]
  (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = compile_profile.summary(compile_profile.load(str(tmp_path)))
  assert "4 s wall, 4 s CPU" in text and "3 compiles, 1 from the persistent cache" in text
  assert "     2      1.5  jit(f)" in text and "     1      0.5  jit(g)" in text
  assert "tests/a_test.py" in text
  assert "compiled more than once: 1 of 2 keys, 1 compiles again, 0 s" in text
  assert "     1      0.5  jit(f)" in text.split("more than once")[1]


def test_the_compile_profile_reads_each_compiles_cache_key():
  """The suite's persistent cache (conftest) logs a miss, with the program's key, before a
  program compiles: the handler keeps it for that compile."""
  pending = threading.local()
  handler = compile_profile._CacheMissHandler(pending)
  log = logging.getLogger(compile_profile._COMPILER_LOGGER)
  level = log.level
  log.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears the logger's cache
  log.addHandler(handler)
  try:
    # A program no other test compiles: one compiled before in the worker would not log.
    jax.jit(lambda x: x * 3.25 + 1).lower(jnp.arange(13.0)).compile()
  finally:
    log.removeHandler(handler)
    log.setLevel(level)
  assert pending.key.startswith("jit__lambda-"), pending.key
