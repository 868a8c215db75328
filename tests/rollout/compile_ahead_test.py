"""`PagedConfig.compile_ahead`: an engine with sized shapes compiles its programs on background
threads from its first admission, and its calls run them without compiling them again."""

import collections
import logging

import jax
import numpy as np
import pytest
from helpers.compiles import compiled_functions

from jaxrl.compile_ahead import with_shardings
from jaxrl.model import Model, get_preset, scan_fit
from jaxrl.rollout import SamplingParams
from jaxrl.rollout import paged as paged_module
from jaxrl.rollout import precompile as precompile_module
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.precompile import compile_engine_ahead, engine_lowerings, engine_programs
from jaxrl.rollout.sampling import NO_FILTER
from jaxrl.sharding import ROLLOUT_RULES, make_mesh
from jaxrl.train import update_plan

EOS, PAD = 2, 0
MODEL = Model(get_preset("tiny"))
# The engine's own programs: decode windows, prefills, page copies, row updates.
PROGRAMS = {
  "jit(_decode_impl)",
  "jit(_prefill_impl)",
  "jit(_prefill_packed_impl)",
  "jit(_copy_pages)",
  "jit(set_rows)",
  "jit(gather_rows)",
}
SMALL = dict(page_size=4, num_pages=64, max_running=4, prefill_chunk=8, decode_steps=2)


@pytest.fixture(scope="module")
def params():
  return MODEL.init(7)


def engine(mesh, params, **cfg):
  config = PagedConfig(**{**SMALL, **cfg})
  e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
  e.update_weights(params, 0)
  return e


def workload(seed=5):
  """Prompts of 1 to 9 tokens (each fits a packed row: a single-turn engine compiles no
  chunked prefill ahead), with lengths that do not depend on the weights, so both engines
  meet the same shapes; GRPO-like groups share their prompts (page copies)."""
  rng = np.random.default_rng(seed)
  ps = [list(rng.integers(3, 60, n)) for n in rng.integers(1, 10, 5)]
  ps = [p for p in ps for _ in range(2)]
  sp = [SamplingParams(max_new_tokens=int(rng.integers(1, 12)), ignore_eos=True) for _ in ps]
  return ps, sp


@pytest.mark.parametrize("keep_turn_kv", [False, True], ids=["single-turn", "multi-turn"])
def test_an_engine_compiles_each_program_once_and_gives_the_tokens_it_gave_before(
  mesh, params, monkeypatch, keep_turn_kv
):
  """From its first admission the engine compiles every program of its shape set on threads;
  a call whose program is compiling waits for that compile, one whose thread has not begun
  compiles it itself. Either way each program compiles once in all (a thread's program that
  missed the calls' caches would compile a second time there), and the tokens are those of an
  engine that compiles as it goes. A multi-turn engine (turns keep their pages) compiles the
  chunked prefill its next turns take too."""
  started = []  # the futures of each start of compiling ahead
  real = paged_module.compile_engine_ahead
  monkeypatch.setattr(
    paged_module, "compile_engine_ahead", lambda *a: started.append(real(*a)) or started[-1]
  )
  ps, sp = workload()
  # The page copy is a module-level function: jit's caches share its programs between engines
  # of the same pool shape, so this test's pool has a size no other engine's has.
  cfg = dict(max_tokens=32, keep_turn_kv=keep_turn_kv, num_pages=59 if keep_turn_kv else 57)
  ahead = engine(mesh, params, **cfg)
  with compiled_functions() as names:
    got = ahead.generate(ps, sp, seed=3)
    assert len(started) == 1
    for future in started[0]:
      assert future.result() is None
  plain = engine(mesh, params, **cfg, compile_ahead=False).generate(ps, sp, seed=3)
  assert len(started) == 1
  for a, b in zip(plain, got, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  counts = collections.Counter(n for n in names if n in PROGRAMS)
  programs = engine_programs(ahead, (1,), (NO_FILTER,), None, chunked=keep_turn_kv)
  calls = ahead._calls
  kinds = {calls._prefill: "_prefill_impl", calls._prefill_packed: "_prefill_packed_impl"}
  kinds[calls.copy_pages] = kinds[calls.copy_ring_pages] = "_copy_pages"
  kinds[ahead._batch._set_rows], kinds[ahead._batch._gather_rows] = "set_rows", "gather_rows"
  want = collections.Counter(f"jit({kinds.get(p.jitted, '_decode_impl')})" for p in programs)
  # The row updates' shapes do not depend on the pool: an engine of another test in this
  # process may have compiled some of them, which then compile here not at all.
  row_updates = ("jit(set_rows)", "jit(gather_rows)")
  assert all(counts[n] <= want[n] and want[n] > 0 for n in row_updates)
  for n in row_updates:
    del counts[n], want[n]
  assert counts == want and len(started[0]) == len(programs)
  assert ("jit(_prefill_impl)" in want) == keep_turn_kv
  # A second generation with other lengths compiles none of them.
  with compiled_functions() as names:
    ahead.generate(*workload(seed=6), seed=4)
  assert not [n for n in names if n in PROGRAMS]


def test_a_call_runs_what_was_compiled_ahead_without_compiling(mesh, params):
  """Programs compiled ahead and finished land where the calls look: the engine's thread then
  compiles none of the engine's programs (the same shardings, the same cache keys)."""
  e = engine(mesh, params, max_tokens=32)
  e._compiled_ahead = True  # as the first admission does, for its stop width and filter
  for future in compile_engine_ahead(e, 1, NO_FILTER):
    future.result()
  with compiled_functions() as names:
    e.generate(*workload(), seed=3)
  assert not [n for n in names if n in PROGRAMS]


def test_a_program_that_fails_to_compile_ahead_is_logged_and_compiled_by_its_call(
  mesh, params, monkeypatch, caplog
):
  """A thread's failure (say, memory while autotuning beside the rollout) loses nothing: it is
  logged, and the call that needs the program compiles it as without compiling ahead."""
  real = paged_module.compile_engine_ahead
  started = []

  def failing(engine, *args):
    # The first program is made to fail: lowered with a wrong argument.
    programs = precompile_module.engine_programs
    monkeypatch.setattr(
      precompile_module,
      "engine_programs",
      lambda *a: [programs(*a)[0]._replace(args=())] + programs(*a)[1:],
    )
    started.append(real(engine, *args))
    return started[-1]

  monkeypatch.setattr(paged_module, "compile_engine_ahead", failing)
  ps, sp = workload()
  with caplog.at_level(logging.WARNING, logger="jaxrl.rollout.precompile"):
    got = engine(mesh, params, max_tokens=32).generate(ps, sp, seed=3)
    assert started and isinstance(started[0][0].exception(), ValueError)
  assert "failed to compile ahead" in caplog.text
  plain = engine(mesh, params, max_tokens=32, compile_ahead=False).generate(ps, sp, seed=3)
  assert [list(r.token_ids) for r in got] == [list(r.token_ids) for r in plain]


def test_bucketed_shapes_and_precompiled_engines_compile_nothing_ahead(mesh, params):
  ps, sp = workload()
  for e in (
    engine(mesh, params, max_tokens=0),
    engine(mesh, params, max_tokens=32, precompile=True),
  ):
    e.generate(ps[:2], sp[:2], seed=0)
    assert not e._compiled_ahead


def test_an_engine_told_to_stop_compiles_nothing_more_ahead(mesh, params, monkeypatch):
  """A worker that stops (the run's end, a preemption, a crash) stops its engine: the threads
  compiling ahead skip the programs they have not begun, instead of compiling them (minutes
  for a hundred) beside whatever the process runs next. Beside it, an engine not stopped
  lowers and compiles them all."""
  lowered = collections.Counter()
  listing = precompile_module.engine_lowerings

  def recorded(e, *args):
    def lower(f, e=e):
      lowered[e.name] += 1
      return f()

    return [(p, lambda f=f, e=e: lower(f, e)) for p, f in listing(e, *args)]

  monkeypatch.setattr(precompile_module, "engine_lowerings", recorded)
  stopped, going_on = engine(mesh, params, max_tokens=32), engine(mesh, params, max_tokens=32)
  stopped.name, going_on.name = "stopped", "going on"
  stopped.stop_precompiling()
  for e in (stopped, going_on):
    futures = compile_engine_ahead(e, 1, NO_FILTER)
    for future in futures:
      future.result(timeout=600)
  assert len(futures) > 3
  assert dict(lowered) == {"going on": len(futures)}


def test_a_precompilation_told_to_stop_ends_after_its_program(mesh, params, monkeypatch):
  """A rollout worker told to stop (the run's end) stops its engine's precompilation, which
  would otherwise run its every program first (minutes for a hundred of them): the program
  under way finishes, no other runs, and the engine is left to compile as calls come."""
  config = PagedConfig(**{**SMALL, "precompile": True, "max_tokens": 32})
  e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
  listing = precompile_module.engine_programs
  assert len(listing(e, (1,), (NO_FILTER,), None)) > 3
  ran = []

  def programs(*args):
    def run(program, *call_args):
      ran.append(program)
      if len(ran) == 2:  # the owner stops it while the second program compiles
        e.stop_precompiling()
      return program.call(*call_args)

    return [p._replace(call=lambda *a, p=p: run(p, *a)) for p in listing(*args)]

  monkeypatch.setattr(precompile_module, "engine_programs", programs)
  e.update_weights(params, 0)  # the first weights precompile the engine
  assert len(ran) == 2 and not e._precompiled
  ps, sp = workload()
  want = engine(mesh, params).generate(ps, sp, seed=0)
  for a, b in zip(e.generate(ps, sp, seed=0), want, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  e.update_weights(params, 1)  # stopped for good: new weights precompile nothing
  assert len(ran) == 2


@pytest.mark.parametrize(
  ("preset", "axes"),
  [("tiny", {"data": 2, "tensor": 2}), ("tiny-moe", {"data": 2, "expert": 2})],
)
def test_an_engine_on_cpu_devices_that_exchange_data_keeps_its_scan_and_races_no_loop(preset, axes):
  """Unlike the learner's, the engine's programs have no collective that XLA:CPU may run out
  of order with a loop of collectives across devices (`update_plan.collectives_racing_loops`,
  which looks inside loops too: the decode window's steps hold the scan over the blocks), so
  on CPU meshes that exchange data the engine keeps its scan (`scan_fit`)."""
  model = Model(get_preset(preset))
  mesh = make_mesh(jax.devices()[:4], axes)
  config = PagedConfig(**SMALL, keep_turn_kv=True)  # with the chunked prefill of next turns
  e = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
  assert scan_fit.exchanges_on_cpu(mesh) and e.model.config.scan_layers
  one_of_each = {}
  shapes = with_shardings(e.model.abstract_params(), e.param_shardings)
  for program, lower in engine_lowerings(e, 1, NO_FILTER, shapes):
    one_of_each.setdefault(program.jitted, lower)
  # Decode window, both prefills, the page copy, the row updates (admission, re-layout).
  assert len(one_of_each) == 6, one_of_each
  for lower in one_of_each.values():
    assert update_plan.collectives_racing_loops(lower().compile().as_text()) == []
