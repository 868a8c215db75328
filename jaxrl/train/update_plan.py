"""What a learner's update needs, planned without running it: its inputs as shapes on the
learner's shardings, and XLA's buffer plan of the compiled update (`Learner.update_memory`).
Works for an abstract learner too (`Learner(..., abstract=True)`), whose mesh may be devices
this process does not have. Also the collectives a compiled program runs (`collective_results`,
`collective_traffic`), read from its HLO text: what a mesh's layout costs in communication,
also for devices this process does not have."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

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


def abstract_sums(learner):
  """The (gradient, metric) sums the micro-steps add into, as shapes on their shardings: what
  the apply step takes (for tracing and planning)."""
  as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
  return jax.tree.map(as_abstract, jax.eval_shape(learner._zero_sums, learner.params))


def compiled_update(learner, batch_size: int, length: int) -> list:
  """The programs of one optimizer update over `batch_size` sequences of `length` tokens
  (dense models, no routing replay), compiled but not run: packed, the micro-step over
  `micro_batch_size` rows (of `pack_length` positions, or longer where `length` needs) and the
  step that applies the gradients; otherwise the one update program."""
  if learner.pack_length:
    micro = abstract_micro(learner, row_length(length - 1, learner.pack_length))
    sums = abstract_sums(learner)
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


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <result shape(s)> <op>(`; asynchronous pairs counted once, at their `-done` (its
# result is the collective's output; a `-start` also holds the operand).
_COLLECTIVE = re.compile(r"= (?P<result>.+?) (?P<op>" + "|".join(COLLECTIVES) + r")(?:-done)?\(")
_SHAPE = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


class Collective(NamedTuple):
  """One collective of a compiled program: its kind and the shapes it produces per device."""

  kind: str
  shapes: tuple[tuple[int, ...], ...]
  bytes: int


def _dtype_bytes(name: str) -> int:
  """Bytes of an HLO element type: the bits its name starts with (`f32`, `bf16`, `s8`,
  `f8e4m3fn`), a byte for `pred` and sub-byte types; 0 for `token`."""
  if name == "pred":
    return 1
  bits = re.match(r"[a-z]+(\d+)", name)
  return max(int(bits[1]) // 8, 1) if bits else 0


def collective_results(hlo_text: str) -> list[Collective]:
  """The collectives in a compiled program's HLO text (`compiled.as_text()`), in order: kind,
  the shapes of their per-device results (a combined collective has several), and bytes."""
  out = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if not match or "-start(" in line:
      continue
    shapes, size = [], 0
    for shape in _SHAPE.finditer(match["result"]):
      dims = tuple(int(n) for n in shape["dims"].split(",") if n)
      shapes.append(dims)
      size += math.prod(dims) * _dtype_bytes(shape["dtype"])
    out.append(Collective(match["op"], tuple(shapes), size))
  return out


def entry_computation(hlo_text: str) -> str:
  """A compiled program's top-level computation in its HLO text: what runs once a call,
  outside every loop body (a collective elsewhere runs once per trip of its loop)."""
  lines = hlo_text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
  end = next(i for i in range(start, len(lines)) if lines[i] == "}")
  return "\n".join(lines[start : end + 1])


def collective_traffic(programs) -> dict[str, dict[str, float]]:
  """Per kind of collective, summed over `programs` (compiled): how many run and the MiB their
  results take on each device (each program once: a micro-step counts once, not per micro-batch)."""
  out: dict[str, dict[str, float]] = {}
  for program in programs:
    for c in collective_results(program.as_text()):
      entry = out.setdefault(c.kind, {"count": 0, "mib": 0.0})
      entry["count"] += 1
      entry["mib"] += c.bytes / 2**20
  return out
