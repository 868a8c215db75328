"""What a learner's update needs, planned without running it: its inputs as shapes on the
learner's shardings, and XLA's buffer plan of the compiled update (`Learner.update_memory`).
Works for an abstract learner too (`Learner(..., abstract=True)`), whose mesh may be devices
this process does not have."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.train.packing import MicroBatch, row_length


def with_shardings(shapes, shardings):
  """Abstract arrays (`jax.ShapeDtypeStruct`) of `shapes`, each with its sharding."""
  return jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    shapes,
    shardings,
  )


def abstract_micro(learner, length: int) -> MicroBatch:
  """A packed micro-batch of `length` positions as shapes (for tracing and planning)."""
  cfg = learner.model.config
  shape = (learner.micro_batch_size, length)
  sds = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype, sharding=learner._row_sharding)  # noqa: E731
  routes = None
  if cfg.is_moe and learner.moe_cfg.routing_replay:
    routes = sds(jnp.int32, *shape, cfg.num_layers, cfg.experts_per_token)
  ints, floats = sds(jnp.int32, *shape), sds(jnp.float32, *shape)
  return MicroBatch(ints, ints, floats, floats, floats, floats, ints, ints, routes)


def compiled_update(learner, batch_size: int, length: int) -> list:
  """The programs of one optimizer update over `batch_size` sequences of `length` tokens
  (dense models, no routing replay), compiled but not run: packed, the micro-step over
  `micro_batch_size` rows (of `pack_length` positions, or longer where `length` needs) and the
  step that applies the gradients; otherwise the one update program."""
  if learner.pack_length:
    micro = abstract_micro(learner, row_length(length - 1, learner.pack_length))
    as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    sums = jax.tree.map(as_abstract, jax.eval_shape(learner._zero_sums, learner.params))
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    return [
      learner._micro_step.lower(
        learner.params, learner.ref_params, sums, micro, scalar, scalar, None
      ).compile(),
      learner._apply.lower(learner.params, learner.opt_state, sums).compile(),
    ]  # fmt: skip
  m = batch_size // learner.micro_batch_size
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=learner._micro_sharding)  # noqa: E731
  per_token = (m, learner.micro_batch_size, length - 1)
  tokens = jax.ShapeDtypeStruct((m, learner.micro_batch_size, length), jnp.int32,
                                sharding=learner._micro_sharding)  # fmt: skip
  return [
    learner._update.lower(
      learner.params, learner.opt_state, learner.ref_params, tokens, shape(*per_token),
      shape(*per_token), shape(*per_token), shape(m, learner.micro_batch_size), None, None,
    ).compile()
  ]  # fmt: skip


def memory_plan(programs) -> dict[str, float]:
  """XLA's buffer plan of whichever of `programs` (compiled) needs more: GiB of its arguments,
  outputs and temporaries."""
  analysis = max(
    (program.memory_analysis() for program in programs),
    key=lambda a: a.argument_size_in_bytes + a.temp_size_in_bytes,
  )
  gib = 2.0**30
  return {
    "arguments_gib": analysis.argument_size_in_bytes / gib,
    "outputs_gib": analysis.output_size_in_bytes / gib,
    "temporaries_gib": analysis.temp_size_in_bytes / gib,
  }


def update_memory(learner, batch_size: int, length: int) -> dict[str, float]:
  """XLA's buffer plan for one optimizer update over `batch_size` sequences of `length`
  tokens (`compiled_update`, `memory_plan`): GiB of its arguments (parameters, optimizer
  state, batch), outputs, and temporaries (gradients, activations, logits chunks). A lower
  bound on what the update needs beside the process's other memory. Packed: the plan of
  whichever of its two programs needs more; `batch_size` does not matter there."""
  return memory_plan(compiled_update(learner, batch_size, length))
