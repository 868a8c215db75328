"""What a learner's update needs, planned without running it: its inputs as shapes on the
learner's shardings, and XLA's buffer plan of the compiled update (`Learner.update_memory`).
Works for an abstract learner too (`Learner(..., abstract=True)`), whose mesh may be devices
this process does not have. Also the collectives a compiled program runs (`collective_results`,
`collective_traffic`), read from its HLO text: what a mesh's layout costs in communication,
also for devices this process does not have."""

from __future__ import annotations

import contextvars
import functools
import math
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.compile_ahead import (
  COMPILE_AHEAD_THREADS,
  abstract,
  compile_in_background,
)
from jaxrl.train.batch import TrainBatch
from jaxrl.train.packing import MicroBatch, row_length


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


def abstract_sums(learner, params=None):
  """The (gradient, metric) sums the micro-steps add into, as shapes on their shardings: what
  the apply step takes (for tracing and planning). `params`: the parameters or their shapes
  (default: the learner's)."""
  params = learner.params if params is None else params
  return abstract(jax.eval_shape(learner._zero_sums, params))


def abstract_state(learner):
  """(params, opt_state, ref_params) as shapes on their shardings: what the update's programs
  are compiled for, read once, so that compiling does not touch arrays an update may donate."""
  return abstract((learner.params, learner.opt_state, learner.ref_params))


def update_lowerings(learner, batch_size: int, length: int, state=None) -> list:
  """The programs of one optimizer update over `batch_size` sequences of `length` tokens
  (dense models, or MoE without an expert placement per micro-batch), as functions that trace
  and lower each (`jax.stages.Lowered`): packed, the micro-step over `micro_batch_size` rows
  (of `pack_length` positions, or longer where `length` needs) and the step that applies the
  gradients; otherwise the one update program. `state`: `abstract_state`'s (default: read now)."""
  params, opt_state, ref_params = state or abstract_state(learner)
  if learner.pack_length:
    micro = abstract_micro(learner, row_length(length - 1, learner.pack_length))
    sums = abstract_sums(learner, params)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    return [
      lambda: learner._micro_step.lower(params, ref_params, sums, micro, scalar, scalar, None),
      lambda: learner._apply.lower(params, opt_state, sums),
    ]
  m = batch_size // learner.micro_batch_size
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=learner._micro_sharding)  # noqa: E731
  per_token = (m, learner.micro_batch_size, length - 1)
  tokens = jax.ShapeDtypeStruct((m, learner.micro_batch_size, length), jnp.int32,
                                sharding=learner._micro_sharding)  # fmt: skip
  return [
    lambda: learner._update.lower(
      params, opt_state, ref_params, tokens, shape(*per_token), shape(*per_token),
      shape(*per_token), shape(m, learner.micro_batch_size), None, None,
    )
  ]  # fmt: skip


def compiled_update(learner, batch_size: int, length: int) -> list:
  """`update_lowerings`' programs, compiled but not run."""
  return [lower().compile() for lower in update_lowerings(learner, batch_size, length)]


def compile_ahead(
  learner, batch_size: int, lengths: Sequence[int], stop: threading.Event | None = None
) -> Future | None:
  """Compiles the update's programs for a step's batches of `batch_size` sequences of these
  token lengths (packed: also rows of `pack_length` positions, and the zeros the sums start from)
  on background threads, one a program; returns a future that is done when all are, or None
  where there is nothing to compile ahead (`Learner.compile_ahead`; how: `jaxrl.compile_ahead`).
  The update's first call then runs them without compiling. The learner's arrays are only
  read for their shapes (now, before the threads start), so the learner may update, lend or
  restore its state meanwhile; once `stop` is set, programs not begun are skipped (the
  update compiles what it needs itself). A learner with an
  expert placement per micro-batch (MoE routing replay, expert-parallel) is compiled by its
  first update as before: its placement's shapes come from the batch."""
  if learner.spreads_experts and learner.moe_cfg.routing_replay:
    return None
  if not learner.pack_length and not lengths:
    return None
  state = abstract_state(learner)

  def compile_all() -> None:
    programs = ahead_programs(learner, batch_size, lengths, state)
    for done in compile_in_background(programs, stop=stop):
      done.result()

  driver = ThreadPoolExecutor(1, thread_name_prefix=f"{COMPILE_AHEAD_THREADS}-driver")
  future = driver.submit(contextvars.copy_context().run, compile_all)
  driver.shutdown(wait=False)  # its thread ends with `compile_all`
  return future


def ahead_programs(learner, batch_size: int, lengths: Sequence[int], state=None) -> list:
  """What `compile_ahead` compiles, as `update_lowerings`' functions: packed, the zeros the
  sums start from, a micro-step per row length (`pack_length` and those `lengths` need) and
  one apply step; padded, an update program per length over one update's rows (a step's
  `batch_size` over `updates_per_step`)."""
  state = state or abstract_state(learner)
  if not learner.pack_length:
    rows = batch_size // learner.updates_per_step
    unique = sorted(set(lengths))
    return [f for n in unique for f in update_lowerings(learner, rows, n, state)]
  pack = learner.pack_length
  micro_steps = [
    update_lowerings(learner, batch_size, r + 1, state)[0] for r in _row_lengths(learner, lengths)
  ]
  apply = update_lowerings(learner, batch_size, pack + 1, state)[1]
  return [lambda: learner._zero_sums.lower(state[0]), *micro_steps, apply]


def precompile(learner, batch_size: int, lengths: Sequence[int]) -> int:
  """`Learner.precompile`: runs the update once per training shape on a batch that changes
  nothing; returns how many shapes."""
  if learner.pack_length:
    # Packed: one update per row length, on a batch whose every advantage is NaN, so the
    # apply step skips it and the state stays as it was (no copy of it needed).
    pack = learner.pack_length
    shapes = _row_lengths(learner, lengths)
    for rows in shapes:
      blank = _blank_batch(learner, batch_size, rows + 1)
      # One sequence per optimizer update, which needs rows of `rows` positions.
      first = slice(None, None, max(batch_size // learner.updates_per_step, 1))
      blank.mask_bt[first, : rows if rows > pack else 1] = 1.0
      blank.advantages_b[:] = np.nan
      jax.block_until_ready(learner.update(blank))
    return len(shapes)
  params, opt_state = learner.params, learner.opt_state
  for length in lengths:
    # `update` donates the state it is given: hand it copies.
    learner.params, learner.opt_state = jax.tree.map(jnp.copy, (params, opt_state))
    jax.block_until_ready(learner.update(_blank_batch(learner, batch_size, length)))
  learner.params, learner.opt_state = params, opt_state
  return len(lengths)


def _row_lengths(learner, lengths: Sequence[int]) -> list[int]:
  """Packed: the row lengths a run's updates take, `pack_length` and those past it that
  sequences of these token lengths need."""
  pack = learner.pack_length
  return sorted({pack, *(row_length(n - 1, pack) for n in lengths)})


def _blank_batch(learner, batch_size: int, length: int) -> TrainBatch:
  cfg = learner.model.config
  replay = cfg.is_moe and learner.moe_cfg.routing_replay  # then routes too, all -1
  routes_lk = (cfg.num_layers, cfg.experts_per_token) if replay else None
  return TrainBatch.blank(batch_size, length, routes_lk)


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


# An HLO computation's first line (`%name (...) -> ... {`, `ENTRY` for the top level), an
# instruction's name and the computations it calls.
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_CALLED = re.compile(
  r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|"
  r"false_computation)=\{?(?P<names>%[\w.\-]+(?:, %[\w.\-]+)*)"
)
_RUNS_COLLECTIVE = re.compile(r" (?:" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives_racing_loops(hlo_text: str) -> list[str]:
  """Collectives of a compiled program (`compiled.as_text()`) that come after a loop holding
  collectives, in the same computation (the top level, or a loop's body), without depending on
  the loop's result: the names of such collectives.

  XLA:CPU (jax 0.10.2) orders such a collective after the loop by scheduling alone, and in a
  program's first runs two simulated devices sometimes ran them in opposite orders: each then
  waits in a different collective for the other and the process aborts after the collective
  timeout. A loop whose result the collective depends on is waited for. On GPUs and TPUs
  collectives run in program order, so this matters only for CPU meshes."""
  computations: dict[str, list[str]] = {}
  entry, lines = None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      lines = computations.setdefault(header["name"], [])
      entry = header["name"] if header["entry"] else entry
    elif line.startswith("}"):
      lines = None
    elif lines is not None and line.strip():
      lines.append(line)

  def called(line: str) -> list[str]:
    return [n.lstrip("%") for m in _CALLED.finditer(line) for n in m["names"].split(", ")]

  @functools.cache
  def holds_collective(name: str) -> bool:
    body = computations.get(name, [])
    return any(_RUNS_COLLECTIVE.search(line) for line in body) or any(
      holds_collective(c) for line in body for c in called(line)
    )

  def racing_in(lines: list[str]) -> list[str]:
    depends_on: dict[str, set[str]] = {}  # instruction -> every instruction it depends on
    loops, racing = [], []
    for line in lines:
      instruction = _INSTRUCTION.match(line)
      if not instruction:
        continue
      name, rest = instruction["name"], instruction["rest"].split(", metadata=")[0]
      operands = {n for n in re.findall(r"%([\w.\-]+)", rest) if n in depends_on}
      depends_on[name] = operands.union(*(depends_on[n] for n in operands))
      if " while(" in rest and any(holds_collective(c) for c in called(rest)):
        loops.append(name)
      elif _RUNS_COLLECTIVE.search(" " + rest) and any(w not in depends_on[name] for w in loops):
        racing.append(name)
    return racing

  # The entry first; a loop's body runs its instructions as the entry does (a scan over the
  # blocks inside a decode window's loop, say), so each computation is looked at alike.
  order = [entry] + sorted(c for c in computations if c != entry)
  return [name for computation in order for name in racing_in(computations.get(computation, []))]
