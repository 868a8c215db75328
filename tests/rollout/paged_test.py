"""Paged continuous-batching engine: parity, preemption, snapshot/continue, streaming, errors."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import tolerance
from helpers.compiles import compiled_functions
from helpers.paged_engines import EOS, MODEL, PAD, engine
from jax._src.array import ArrayImpl

from jaxrl.compile_ahead import abstract
from jaxrl.model import Model, get_preset
from jaxrl.rl.experience import logprob_mismatch
from jaxrl.rollout import SamplingParams, StaticEngine
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.precompile import engine_lowerings
from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.sampling import NO_FILTER, SORT_ALL, TOP_K_CANDIDATES
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig

# Log-probs computed two ways (engines, windows, shardings) differ by the rounding of the model.
TERMS = tolerance.model_terms(MODEL.config)


def prompts(n, rng, longest=20):
  return [list(rng.integers(3, 60, rng.integers(1, longest))) for _ in range(n)]


def test_the_decode_step_runs_its_kernels_on_each_devices_heads(mesh, params):
  """On a mesh the engine passes its `KernelMesh` down to the kernels and page writes, which
  then run in a shard_map (`jaxrl.kernels.partitioning`); on one device they do not. The
  tests on `mesh` that compare tokens with the static engine check the results."""

  def decode_text(on):
    e = engine(on, params, page_size=8, num_pages=16, max_running=4)
    lower = next(
      lower
      for p, lower in engine_lowerings(e, 1, NO_FILTER, abstract(e.params))
      if p.jitted in e._calls.decoders.values()
    )
    return lower().as_text()

  assert "sdy.manual_computation" in decode_text(mesh)
  assert "sdy.manual_computation" not in decode_text(make_mesh(jax.devices()[:1], {"data": 1}))


def test_greedy_matches_static_engine_under_preemption(mesh, params):
  rng = np.random.default_rng()
  ps = prompts(12, rng)
  # Every request runs its 24 tokens: a draw whose greedy tokens met EOS early ran without a
  # preemption (once in 7 runs of the file on 2026-12-07), and checked nothing it is named for.
  sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
  static = StaticEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD)
  static.update_weights(params, 0)
  expected = static.generate(ps, sp, seed=0)
  # 14 pages of 8 slots cannot hold 8 running requests of 25 to 43 tokens (4 pages or more
  # each): preemption must happen.
  paged = engine(mesh, params, page_size=8, num_pages=14, max_running=8, prefill_chunk=8)
  got = paged.generate(ps, sp, seed=0)
  assert paged.num_preemptions > 0
  for a, b in zip(expected, got, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    tolerance.assert_close(b.logprobs, a.logprobs, n=TERMS)
    assert a.finish_reason == b.finish_reason
  assert paged.allocator.num_free == paged.allocator.num_pages and not paged.has_work


def test_row_updates_of_one_row_count_run_one_program(mesh, params):
  """Admissions of any number of requests and the kills of preempted ones write rows through
  one program per row count and stop-id width: every update has an entry for each row, those
  it does not write aimed out of range. (The preemption test's engine: no program of its
  own.)"""
  rng = np.random.default_rng()
  # As in the preemption test: 8 requests of 25 to 43 tokens do not fit 14 pages of 8 slots.
  sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
  paged = engine(mesh, params, page_size=8, num_pages=14, max_running=8, prefill_chunk=8)
  set_rows, written = paged._batch._set_rows, []

  def recorded(state, sampling, rows_a, new_state, new_sampling):
    rows = state.tokens_b.shape[0]
    assert rows_a.shape == (rows,) and new_state.tokens_b.shape == (rows,)
    written.append((rows, int((rows_a < rows).sum())))
    return set_rows(state, sampling, rows_a, new_state, new_sampling)

  paged._batch._set_rows = recorded
  paged.generate(prompts(12, rng), [sp] * 12, seed=0)
  assert paged.num_preemptions > 0  # kills wrote rows too
  assert len({count for _, count in written}) > 1, written  # updates of several sizes
  assert paged._calls.compiled(recorded) == len({rows for rows, _ in written})


def test_attention_sinks_decode_like_the_static_engine(mesh):
  """A model with attention sinks (gpt-oss), windowed every other layer: the paged engine's
  decode (paged attention with sinks, rings of pages) and its chunked and packed prefills
  give the static engine's greedy tokens."""
  cfg = get_preset(
    "tiny", num_layers=3, attention_sinks=True, qkv_bias=True, sliding_window=4,
    sliding_layers=(0, 2),
  )  # fmt: skip
  model = Model(cfg)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(model.init(5))
  rng = np.random.default_rng(5)
  # Sinks around the logits' size (they take a sizeable share of every softmax), biases on.
  scale = [1.0 if "sinks" in jax.tree_util.keystr(path) else 0.1 for path, _ in leaves]
  params = jax.tree_util.tree_unflatten(
    treedef,
    [
      x + c * rng.standard_normal(x.shape, np.float32)
      for (_, x), c in zip(leaves, scale, strict=True)
    ],
  )
  ps = prompts(6, np.random.default_rng(0))
  sp = SamplingParams(temperature=0.0, max_new_tokens=16)
  static = StaticEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD)
  static.update_weights(params, 0)
  expected = static.generate(ps, sp, seed=0)
  for pack in (False, True):
    config = PagedConfig(page_size=4, num_pages=64, max_running=4, prefill_chunk=8,
                         pack_prefill=pack)  # fmt: skip
    paged = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
    paged.update_weights(params, 0)
    for a, b in zip(expected, paged.generate(ps, sp, seed=0), strict=True):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      tolerance.assert_close(b.logprobs, a.logprobs, n=TERMS)


# Greedy is `slow`: a sampled continuation must also carry the request's random stream, and
# greedy decoding is held to the static engine's by test_greedy_matches_static_engine.
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_snapshot_continues_on_another_engine_exactly(mesh, params, temperature):
  """Stopped after a few single-token steps, continued on an engine with decode windows."""
  rng = np.random.default_rng()
  prompt = prompts(1, rng)[0]
  sp = SamplingParams(temperature=temperature, max_new_tokens=20, ignore_eos=True)
  reference = engine(mesh, params)
  reference.submit(prompt, sp, request_id="a", seed=7)
  whole = list(reference.stream())[0]

  first = engine(mesh, params, decode_steps=1)
  first.submit(prompt, sp, request_id="a", seed=7)
  for _ in range(int(rng.integers(2, 8))):
    assert not first.step()
  record = first.snapshot("a")
  assert 0 < len(record.token_ids) < 20 and record.finish_reason is None
  moved = RequestRecord.from_dict(json.loads(json.dumps(record.to_dict())))
  second = engine(mesh, params, decode_steps=4)
  second.submit(moved)
  continued = list(second.stream())[0]
  assert continued.token_ids == whole.token_ids
  tolerance.assert_close(continued.logprobs, whole.logprobs, n=TERMS)
  assert continued.token_ids[: len(record.token_ids)] == record.token_ids


@pytest.mark.slow  # 48 s of a full run; the snapshot test continues single steps in windows
def test_decode_windows_give_the_tokens_of_single_steps(mesh, params):
  """Sampled, with stop tokens, ragged budgets and preemption: a window changes no token."""
  rng = np.random.default_rng()
  ps = prompts(10, rng)
  sampling = [
    SamplingParams(
      temperature=1.0,
      top_k=int(rng.choice([0, 5])),
      max_new_tokens=int(rng.integers(1, 30)),
      stop_token_ids=tuple(int(t) for t in rng.integers(3, 60, 2)),
    )
    for _ in ps
  ]
  small = dict(page_size=4, num_pages=24, max_running=6, prefill_chunk=8)
  outs = {}
  for steps in (1, 3):  # 3: windows that end mid-budget and mid-page (8: every other test)
    e = engine(mesh, params, decode_steps=steps, **small)
    outs[steps] = e.generate(ps, sampling, seed=11)
    assert e.allocator.num_free == e.allocator.num_pages and not e.has_work
    assert e._calls._steps == steps
  for one, three in zip(outs[1], outs[3], strict=True):
    for other in (three,):
      np.testing.assert_array_equal(one.token_ids, other.token_ids)
      tolerance.assert_close(other.logprobs, one.logprobs, n=TERMS)
      assert one.finish_reason == other.finish_reason
  assert any(c.finish_reason == "stop" for c in outs[1])
  assert any(c.finish_reason == "length" for c in outs[1])


def test_decode_windows_chain_on_the_device_without_waiting_for_the_host(mesh, params, monkeypatch):
  """Each step dispatches the next window from the state the last one left on the device and
  only then reads the last one back: the device never waits for the host mid-run."""
  rng = np.random.default_rng()
  e = engine(mesh, params, decode_steps=2, max_running=8)
  budgets = [int(n) for n in rng.integers(9, 30, 6)]
  for i, n in enumerate(budgets):
    e.submit(prompts(1, rng)[0], SamplingParams(max_new_tokens=n, ignore_eos=True), seed=i)
  assert e.step() == []  # admission, prefill and the first window: nothing read yet
  reads = []  # the windows dispatched at each device-to-host copy
  copy = ArrayImpl._value

  def counted(array):
    if array._npy_value is None:
      reads.append(e.num_windows)
    return copy.fget(array)

  monkeypatch.setattr(ArrayImpl, "_value", property(counted))
  e.step()
  monkeypatch.undo()
  # The first window's tokens, log-probs and steps taken, read after the second was dispatched.
  assert reads == [2, 2, 2]
  done = list(e.stream())
  assert sorted(len(r.token_ids) for r in done) == sorted(budgets)
  assert e.num_host_waits == 1  # the last window, when nothing is left to dispatch
  assert e.num_windows == -(-max(budgets) // 2)


# Greedy is `slow`: sampled rows (same seeds, so the same tokens unshared) check the same pages.
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_shared_prompt_pages_give_the_tokens_of_unshared_requests(mesh, params, temperature):
  """G responses to one prompt: prefilled once, whole pages shared, the partly filled page
  copied; under preemption and a snapshot moved mid-run, the tokens are those of unshared
  requests."""
  rng = np.random.default_rng()
  group = 4
  base = [list(rng.integers(3, 60, n)) for n in (8, 9, int(rng.integers(2, 30)))]
  ps = [p for p in base for _ in range(group)]  # 8 and 9 tokens: the last page full and not
  sp = SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True)
  # 13 pages of 4 on each of data's 2 shards: 26 cannot hold 12 requests of up to 45 tokens.
  small = dict(page_size=4, num_pages=13, max_running=8, prefill_chunk=8, decode_steps=2)
  outs = {}
  for share in (False, True):
    e = engine(mesh, params, share_prefix=share, **small)
    ids = [e.submit(p, sp, seed=i) for i, p in enumerate(ps)]
    done = {r.request_id: r for r in e.step()}
    if share:  # 8-token prompt: 7 cached = 1 whole page shared, 1 copied; 9: 2 shared, none
      assert e.num_shared_prefill_tokens >= 3 * 7 + 3 * 8
      moved = e.snapshot(ids[1])  # a follower, moved out and back in mid-run
      e.submit(RequestRecord.from_dict(json.loads(json.dumps(moved.to_dict()))))
    for r in e.stream():
      done[r.request_id] = r
    outs[share] = [done[i] for i in ids]
    assert e.allocator.num_free == e.allocator.num_pages and not e.has_work
    assert e.num_preemptions > 0
  for a, b in zip(outs[False], outs[True], strict=True):
    assert a.token_ids == b.token_ids
    tolerance.assert_close(b.logprobs, a.logprobs, n=TERMS)


# `slow` (51 s of a full run with windows of 4): greedy_matches_static_engine_under_preemption
# and the kept-pages eviction test run preemption by default.
@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_out_of_pages_preemption_loses_no_request(mesh, params, decode_steps):
  rng = np.random.default_rng()
  ps = prompts(24, rng, longest=12)
  budgets = [int(x) for x in rng.integers(1, 40, len(ps))]
  e = engine(
    mesh,
    params,
    page_size=4,
    num_pages=20,
    max_running=16,
    prefill_chunk=4,
    decode_steps=decode_steps,
  )
  ids = [
    e.submit(p, SamplingParams(max_new_tokens=m, stop_token_ids=()), seed=i)
    for i, (p, m) in enumerate(zip(ps, budgets, strict=True))
  ]
  done, steps = {}, 0
  while e.has_work:
    done.update((r.request_id, r) for r in e.step())
    steps += 1
  assert e.num_preemptions > 0
  assert set(done) == set(ids)
  # Shapes are bucketed: rows in {2, 4, 8, 16} x page-table widths in {1, 2, 4, 8, 16}, one
  # window size, one sampler filter (no top-k or top-p).
  assert steps > 40 // decode_steps and e._calls.compiled(e._calls._prefill) <= 20
  assert set(e._calls.decoders) == {NO_FILTER}
  assert e._calls.compiled(e._calls.decoders[NO_FILTER]) <= 20
  for rid, p, m in zip(ids, ps, budgets, strict=True):
    r = done[rid]
    assert r.prompt_ids == p
    assert len(r.token_ids) == len(r.logprobs) == len(r.versions)
    assert len(r.token_ids) == m or r.token_ids[-1] == EOS
  assert e.allocator.num_free == e.allocator.num_pages  # 20 on each of 2 devices of data


def test_stream_yields_short_requests_first_and_abort_returns_partials(mesh, params):
  rng = np.random.default_rng()
  e = engine(mesh, params)
  e.submit(prompts(1, rng)[0], SamplingParams(max_new_tokens=2), request_id="short")
  long = SamplingParams(max_new_tokens=40, ignore_eos=True)  # 4 windows of 8 do not end it
  e.submit(prompts(1, rng)[0], long, request_id="long")
  e.submit(prompts(1, rng)[0], long, request_id="other")
  first = next(e.stream())  # two calls: the first window is read back by the second
  assert first.request_id == "short"
  for _ in range(2):
    e.step()
  # Four windows dispatched; abort waits for the one in flight and keeps its tokens.
  partial = {r.request_id: r for r in e.abort(["long", "other"])}
  for r in partial.values():
    assert r.finish_reason is None
    assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == 32
  assert not e.has_work and e.allocator.num_free == e.allocator.num_pages


def test_abort_of_an_unknown_id_aborts_nothing(mesh, params):
  e = engine(mesh, params)
  long = SamplingParams(max_new_tokens=40, ignore_eos=True)
  e.submit([5, 6, 7], long, request_id="a")
  e.step()
  e.submit([5, 6], long, request_id="w")
  for ids in (["a", "typo"], ["w", "w"]):
    with pytest.raises(KeyError, match="nothing was aborted"):
      e.abort(ids)
  assert set(e.running) == {"a"} and [r.request_id for r in e.waiting] == ["w"]
  partial = {r.request_id: r for r in e.abort(["w", "a"])}
  assert len(partial["a"].token_ids) > 0 and partial["w"].token_ids == []
  assert not e.has_work and e.allocator.num_free == e.allocator.num_pages


def test_every_request_ending_in_the_window_read_back_for_pages(mesh, params):
  """Out of pages, the engine reads the window in flight back; when that ends every running
  request, no window is dispatched over an empty batch and both come back. On a mesh whose
  rows do not split (over `data`, each shard would have pages of its own for one of them)."""
  mesh = make_mesh(jax.devices()[:2], {"tensor": 2})
  # EOS ignored: the weights are a random draw, and a greedy EOS would end A or B early.
  sp = SamplingParams(temperature=0.0, max_new_tokens=13, ignore_eos=True)
  roomy = engine(mesh, params, page_size=4, num_pages=16, decode_steps=4)
  ahead = roomy.generate([[5, 6, 7]], sp, seed=0)[0].token_ids
  # A stops at its second token; B ends by length; A would need a third page for the next
  # window, which the 4 pages (2 each) do not have: `_grow_pages` reads the window back.
  stop = dataclasses.replace(sp, stop_token_ids=(int(ahead[1]),))
  e = engine(mesh, params, page_size=4, num_pages=4, decode_steps=4)
  e.submit([5, 6, 7], stop, request_id="A")
  e.submit([9, 10, 11, 12, 13], dataclasses.replace(sp, max_new_tokens=4), request_id="B")
  done = {r.request_id: r for r in e.stream()}
  assert done["A"].token_ids == list(ahead[: list(ahead).index(ahead[1]) + 1])
  assert done["A"].finish_reason == "stop" and done["B"].finish_reason == "length"
  assert len(done["B"].token_ids) == 4 and e.allocator.num_free == 4


@pytest.mark.parametrize("decode_steps", [1, 2])
def test_weight_update_takes_effect_at_the_next_window(mesh, params, decode_steps):
  rng = np.random.default_rng()
  e = engine(mesh, params, version=3, decode_steps=decode_steps)
  sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
  e.submit(prompts(1, rng)[0], sp, request_id="a")
  for _ in range(4):
    e.step()
  e.update_weights(jax.tree.map(lambda x: x * 1.01, params), version=4)
  record = list(e.stream())[0]
  before = 4 * decode_steps
  assert record.versions == [3] * before + [4] * (12 - before)


def test_released_engine_frees_its_pool_and_generates_the_same_after_new_weights(mesh, params):
  rng = np.random.default_rng()
  ps, sp = prompts(3, rng), SamplingParams(temperature=0.0, max_new_tokens=8)
  e = engine(mesh, params)
  expected = e.generate(ps, sp, seed=0)
  e.submit(ps[0], sp, request_id="busy")
  with pytest.raises(RuntimeError, match="0 running and 1 waiting requests"):
    e.release_memory()
  e.abort(["busy"])
  e.release_memory()
  assert e.params is None and e._kv is None
  with pytest.raises(RuntimeError, match="before update_weights"):
    e.generate(ps, sp, seed=0)
  e.update_weights(params, version=1)
  got = e.generate(ps, sp, seed=0)
  for a, b in zip(expected, got, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  static = StaticEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD)
  static.update_weights(params, 0)
  static.release_memory()
  with pytest.raises(RuntimeError, match="before update_weights"):
    static.generate(ps, sp, seed=0)


def test_logprobs_match_the_learner(mesh, params):
  rng = np.random.default_rng()
  e = engine(mesh, params, page_size=8, num_pages=64)
  outs = e.generate(
    prompts(16, rng),
    SamplingParams(temperature=0.8, max_new_tokens=16),
    seed=int(rng.integers(1 << 20)),
  )
  learner = Learner(
    MODEL,
    make_mesh(jax.devices()[4:], {"fsdp": 4}),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(),
    updates_per_step=1,
    micro_batch_size=16,
    temperature=0.8,
    params=params,
  )
  mismatch = logprob_mismatch(learner, outs, PAD)
  scale = max(np.abs(c.logprobs).max() for c in outs)
  assert mismatch["max_abs_diff"] <= tolerance.atol(TERMS, scale), mismatch


def test_bad_requests_are_rejected_at_submit(mesh, params):
  e = engine(mesh, params, page_size=8, num_pages=4)
  with pytest.raises(ValueError, match="page budget.*lower max_new_tokens to at most 23"):
    e.submit([5] * 10, SamplingParams(max_new_tokens=30))
  with pytest.raises(ValueError, match="page budget.*shorten the prompt"):
    e.submit([5] * 33, SamplingParams(max_new_tokens=1))
  with pytest.raises(ValueError, match="max_seq_len"):
    e.submit([5] * 65, SamplingParams(max_new_tokens=1))
  # A prompt of max_seq_len tokens has no room for a token (it used to wait forever).
  with pytest.raises(ValueError, match="no room for a new token.*at most 63"):
    e.submit([5] * 64, SamplingParams(max_new_tokens=1))
  done = RequestRecord("done", [5], SamplingParams(max_new_tokens=2), token_ids=[6, 7])
  with pytest.raises(ValueError, match="already holds 2 generated tokens"):
    e.submit(done)
  with pytest.raises(ValueError, match="seed"):  # it used to fail after taking pages
    e.submit([5], SamplingParams(), seed=-1)
  with pytest.raises(ValueError, match="stop_token_ids"):
    SamplingParams(stop_token_ids=(-1,))
  with pytest.raises(ValueError, match="empty prompt"):
    e.submit([], SamplingParams())
  with pytest.raises(ValueError, match="top_k"):
    e.submit([5], SamplingParams(top_k=-1))
  e.submit([5, 6], SamplingParams(max_new_tokens=3), request_id="x")
  with pytest.raises(ValueError, match="already"):
    e.submit([5, 6], SamplingParams(max_new_tokens=3), request_id="x")
  # Every token but the last is cached: 32 tokens and 1 new fill the 4 pages exactly.
  full = e.generate([[5] * 32], SamplingParams(max_new_tokens=1), seed=0)[0]
  assert len(full.token_ids) == 1
  with pytest.raises(ValueError, match="num_pages"):
    PagedConfig(num_pages=0)


def test_precompiled_engine_compiles_nothing_while_it_generates(mesh, params):
  """Every program a run can meet is compiled when the engine first gets weights: decode
  windows, prefills and the row updates between windows, for requests with up to
  `MIN_STOP_WIDTH` stop ids (the default covers them all)."""
  rng = np.random.default_rng()
  # 16 positions of 8-slot pages: page tables of 1 or 2 pages; rows of 2 and 4.
  small = Model(get_preset("tiny", max_seq_len=16))
  cfg = dict(page_size=8, num_pages=16, max_running=4, prefill_chunk=8, decode_steps=2)

  def run(precompile):
    e = PagedEngine(
      small, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD,
      config=PagedConfig(precompile=precompile, **cfg),
    )  # fmt: skip
    e.update_weights(params, 0)

    def compiled():
      calls = e._calls
      prefills = calls.compiled(calls._prefill), calls.compiled(calls._prefill_packed)
      # The last: shapes of every program, row updates too (whichever engine compiled them).
      return {w: calls.compiled(d) for w, d in calls.decoders.items()}, prefills, calls.compiled()

    before = compiled()
    with compiled_functions() as names:
      for i, (prompt, sampling) in enumerate(zip(ps, sp, strict=True)):
        e.submit(prompt, sampling, request_id=str(i), seed=i)
      done = {r.request_id: r.token_ids for r in e.stream()}
    return before, compiled(), done, names

  ps = [list(rng.integers(3, 60, n)) for n in rng.integers(1, 9, 6)]
  # Half the requests use top-k: windows with and without the sampler's filter. Stop ids:
  # none, one or two besides the end token. Six requests in four rows: the batch grows and
  # shrinks (admissions, kills, re-layouts).
  sp = [
    SamplingParams(max_new_tokens=16 - len(p), top_k=5 * (i % 2), stop_token_ids=[3, 4][: i % 3])
    for i, p in enumerate(ps)
  ]
  before, after, tokens, names = run(precompile=True)
  assert sorted(before[0]) == [SORT_ALL, NO_FILTER, TOP_K_CANDIDATES]
  assert all(before[0].values()) and all(before[1])  # chunked and packed prefills
  assert after == before and names == []  # nothing compiled while generating
  _, plain_after, plain_tokens, _ = run(precompile=False)
  # A plain run meets a subset of the shapes.
  assert all(a <= b for a, b in zip(plain_after[1], before[1], strict=True))
  assert 0 < plain_after[2] <= before[2]
  assert tokens == plain_tokens and len(tokens) == 6  # precompiling wrote nothing


def test_shapes_sized_for_max_tokens_give_the_same_tokens_in_one_program_per_row_count(
  mesh, params
):
  """`max_tokens`: every page table and prefill chunk is sized for the longest sequence, so
  the engine compiles one decode and one prefill program per row count, and a precompile
  covers exactly those; the tokens are those of bucketed shapes. A longer sequence still
  runs, in a wider table."""
  rng = np.random.default_rng(5)
  ps = [list(rng.integers(3, 60, n)) for n in rng.integers(1, 9, 8)]
  # No EOS: the lengths, so the shapes each engine meets, must not depend on the random
  # weights (an early EOS left the bucketed engine as few tables as the sized one).
  sp = [SamplingParams(max_new_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in ps]
  cfg = dict(page_size=4, num_pages=64, max_running=4, prefill_chunk=8, decode_steps=2)
  bucketed = engine(mesh, params, max_tokens=0, **cfg)
  sized = engine(mesh, params, max_tokens=32, **cfg)
  want, got = bucketed.generate(ps, sp, seed=3), sized.generate(ps, sp, seed=3)
  for a, b in zip(want, got, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  row_counts = set(sized._block_row_counts(sized.rows_per_shard))
  decoded = sized._calls.compiled(sized._calls.decoders[NO_FILTER])
  assert decoded <= len(row_counts) < bucketed._calls.compiled(bucketed._calls.decoders[NO_FILTER])
  assert sized._calls.compiled(sized._calls._prefill) <= len(row_counts)
  assert sized._calls.compiled(sized._calls._prefill_packed) <= len(row_counts)
  # A precompiled engine sized so: one program per row count and filter, one prefill of each
  # kind (packed rows; chunks, for sequences longer than `prefill_chunk` or after a kept
  # turn's pages) per row count, a page copy per bucket of copies (1, 2 or 4), and the row
  # updates: an admission per row count, a re-layout into and out of the largest from each
  # smaller one.
  fresh = engine(mesh, params, max_tokens=32, **cfg)
  shapes = fresh.precompile(filter_widths=(NO_FILTER,))
  n = len(row_counts)
  assert shapes == 3 * n + 3 + n + 2 * (n - 1)
  fresh.generate(ps, sp, seed=3)
  assert fresh._calls.compiled(fresh._calls.decoders[NO_FILTER]) == len(row_counts)
  assert fresh._calls.compiled(fresh._calls._prefill) == len(row_counts)
  assert fresh._calls.compiled(fresh._calls._prefill_packed) == len(row_counts)
  # Past max_tokens: a wider table, compiled when met, and the bucketed engine's tokens.
  long_prompt = [list(rng.integers(3, 60, 30))]
  sampling = SamplingParams(max_new_tokens=12)
  np.testing.assert_array_equal(
    sized.generate(long_prompt, sampling, seed=1)[0].token_ids,
    bucketed.generate(long_prompt, sampling, seed=1)[0].token_ids,
  )


def test_an_engine_of_the_same_settings_runs_the_first_ones_programs_and_counts_its_own(
  mesh, params
):
  """A second engine of equal settings (a worker restarted in the process) traces and
  compiles none of the programs the first one compiled, and gives the same tokens; each
  engine counts the shapes it ran, not the process's (what a third engine compiles into the
  shared programs is not counted by the first two)."""
  rng = np.random.default_rng(11)
  ps = [list(rng.integers(3, 60, n)) for n in rng.integers(1, 9, 6)]
  sp = [SamplingParams(max_new_tokens=int(rng.integers(1, 12)), ignore_eos=True) for _ in ps]
  # A pool size no other test's engine has: this test's programs are its own.
  cfg = dict(page_size=4, num_pages=53, max_running=4, prefill_chunk=8, decode_steps=2)
  first = engine(mesh, params, **cfg)
  want = first.generate(ps, sp, seed=3)
  with compiled_functions() as names:
    second = engine(mesh, params, **cfg)
    got = second.generate(ps, sp, seed=3)
  assert not [n for n in names if "_impl" in n or "_copy_pages" in n or "zeros" in n], names
  for a, b in zip(want, got, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  counted = first.compiled_shapes()
  assert second.compiled_shapes() == counted > 0
  # One request: a row count the others never ran, compiled into the programs they share.
  decoder = first._calls.decoders[NO_FILTER]
  shared = decoder._cache_size()  # JAX's count: the process's
  third = engine(mesh, params, **cfg)
  third.generate(ps[:1], sp[:1], seed=3)
  assert decoder._cache_size() > shared
  assert first.compiled_shapes() == second.compiled_shapes() == counted
