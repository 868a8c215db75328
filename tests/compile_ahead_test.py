"""`jaxrl.compile_ahead`: programs compiled on background threads, and their owner stopping them;
functions whose jits share their traces and programs."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import TRACE_EVENT, compiled_functions
from helpers.train_batches import random_batch

from jaxrl.compile_ahead import compile_in_background, shared_function
from jaxrl.model import Model, get_preset
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig


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


def _scaled(scale, x):
  return jnp.sin(x) * scale


def test_jits_of_a_shared_function_trace_and_compile_once():
  """Jits made apart (new meshes and shardings, equal by value) of one shared function trace,
  lower and compile a shape once; another bound value is another function."""
  assert shared_function(_scaled, 2.0) is shared_function(_scaled, 2.0)
  assert shared_function(_scaled, 3.0) is not shared_function(_scaled, 2.0)
  x = np.arange(8, dtype=np.float32)
  with compiled_functions(TRACE_EVENT) as traced, compiled_functions() as compiled:
    for _ in range(3):
      mesh = make_mesh(jax.devices()[:2], {"data": 2})
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
      jitted = jax.jit(shared_function(_scaled, 2.0), out_shardings=sharding)
      np.testing.assert_allclose(jitted(x), np.sin(x) * 2.0, rtol=1e-6)
  assert traced.count("_scaled") == 1 and compiled.count("jit(_scaled)") == 1
  with compiled_functions() as compiled:
    np.testing.assert_allclose(
      jax.jit(shared_function(_scaled, 3.0))(x), np.sin(x) * 3.0, rtol=1e-6
    )
  assert compiled.count("jit(_scaled)") == 1


def test_a_shared_function_binds_only_hashable_values():
  with pytest.raises(TypeError, match=r"shared_function\('_scaled'\).*hashable"):
    shared_function(_scaled, [2.0])


def test_a_second_learner_of_equal_settings_compiles_nothing_and_counts_its_own_shapes():
  """Models of equal configs are equal; a learner built again (a job's stages rebuilt after a
  fault, a resume in the same process) initialises its parameters and optimizer and runs its
  updates and log-probs with the programs the first one traced and compiled, and gets the same
  values; each learner counts the shapes it ran. A learner of another model, or of another
  loss, traces its own."""
  config = get_preset("tiny", num_layers=1, max_seq_len=16)
  assert Model(config) == Model(config) and hash(Model(config)) == hash(Model(config))
  assert Model(config) != Model(get_preset("tiny", num_layers=2, max_seq_len=16))

  recompute = LossConfig(proximal="recompute")  # the update and the log-probs

  def learner(config=config, loss=recompute):
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    optimizer = OptimizerConfig(learning_rate=1e-3)
    return Learner(
      Model(config), mesh, TRAIN_RULES, loss=loss, optimizer=optimizer, updates_per_step=1,
      micro_batch_size=2, temperature=1.0,
    )  # fmt: skip

  batch = random_batch(np.random.default_rng())
  first = learner()
  first_metrics = jax.device_get(first.update(batch))
  assert (first.compiled_shapes("update"), first.compiled_shapes("logprobs")) == (1, 1)
  with compiled_functions(TRACE_EVENT) as traced, compiled_functions() as compiled:
    second = learner()
    second_metrics = jax.device_get(second.update(batch))
  # (shapes are still worked out abstractly: the optimizer state's, `jax.eval_shape`)
  assert compiled == [] and not {"init", "update", "logprobs"} & set(traced), (traced, compiled)
  assert second.compiled_shapes() == first.compiled_shapes() == 2
  assert second_metrics == first_metrics
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params), strict=True):
    np.testing.assert_array_equal(a, b)
  with compiled_functions(TRACE_EVENT) as traced:  # another loss: its own update program
    other = learner(loss=LossConfig(proximal="recompute", clip_high=0.28))
    other.update(batch)
  assert {"update", "logprobs"} <= set(traced), traced
  assert first.compiled_shapes() == 2  # what the others ran is theirs
  with compiled_functions() as compiled:  # a learner of another model compiles its own
    learner(dataclasses.replace(config, num_layers=2))
  assert len(compiled) >= 2, compiled


def test_a_second_warm_up_of_equal_settings_compiles_nothing():
  """A job built again in the process runs its supervised warm-up with the step the first
  one traced and compiled, and gets the same values; another learning rate traces its own."""
  from jaxrl.train import SupervisedTrainer

  config = get_preset("tiny", num_layers=1, max_seq_len=16)

  def warmed_up(learning_rate=1e-2):
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    learner = Learner(
      Model(config), mesh, TRAIN_RULES, loss=LossConfig(), optimizer=OptimizerConfig(),
      updates_per_step=1, micro_batch_size=2, temperature=1.0,
    )  # fmt: skip
    trainer = SupervisedTrainer(learner, learning_rate)
    metrics = [jax.device_get(trainer.step(batch.tokens_bt, batch.mask_bt)) for _ in range(2)]
    return metrics, jax.device_get(learner.params)

  batch = random_batch(np.random.default_rng())
  first_metrics, first_params = warmed_up()
  with compiled_functions(TRACE_EVENT) as traced, compiled_functions() as compiled:
    second_metrics, second_params = warmed_up()
  assert compiled == [] and "step" not in traced, (traced, compiled)
  assert second_metrics == first_metrics
  for a, b in zip(jax.tree.leaves(first_params), jax.tree.leaves(second_params), strict=True):
    np.testing.assert_array_equal(a, b)
  with compiled_functions(TRACE_EVENT) as traced:
    warmed_up(learning_rate=3e-3)
  assert "step" in traced, traced
