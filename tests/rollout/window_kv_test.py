"""Rings of KV pages for sliding-window layers (`window_kv`): the paged engine gives the tokens
it gives with every position in one pool, in every path that fills or moves pages: packed and
chunked prefill, decode windows, shared prompts, preemption, kept turns, snapshots."""

import itertools

import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import Model, get_preset
from jaxrl.rollout import SamplingParams
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.window_kv import ring_size, ring_table, window_pool
from jaxrl.sharding import ROLLOUT_RULES

EOS, PAD = 2, 0
# Gemma 3's layout in small: a 5-position window in layers 0, 1 and 3, global layer 2.
MODEL = Model(
  get_preset(
    "tiny", num_layers=4, sliding_window=5, sliding_layers=(0, 1, 3), local_rope_theta=100.0,
    norm_position="sandwich", norm_scale_plus_one=True, mlp_activation="gelu_tanh",
  )
)  # fmt: skip
TERMS = tolerance.model_terms(MODEL.config)
# Rings of 4 pages of 4 (a window of 5 plus a chunk of 8: up to 12 positions, 4 pages): a
# 60-token sequence goes round its ring four times. Tables sized for the model's 64 positions
# (one program per row count: the tests' time is mostly compilation); the shared-prompt test
# runs bucketed shapes.
SMALL = dict(
  page_size=4, num_pages=96, max_running=6, prefill_chunk=8, decode_steps=3, max_tokens=64,
  compile_ahead=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def params():
  return MODEL.init(np.random.randint(1 << 16))


@pytest.fixture(scope="module")
def one_pool(mesh, params):
  """Every layer in one pool: the reference the tests share (one compilation per row count;
  sampling keys depend only on each request's seed, so its tokens do not depend on which
  requests run beside them)."""
  return engine(mesh, params, window_pages=0)


@pytest.fixture(scope="module")
def rings(mesh, params):
  return engine(mesh, params)


def engine(mesh, params, **cfg):
  config = PagedConfig(**{**SMALL, **cfg})
  e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
  e.update_weights(params, 0)
  return e


def prompts(rng, lengths):
  return [list(rng.integers(3, 60, n)) for n in lengths]


def assert_same(got, expected):
  for a, b in zip(got, expected, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    tolerance.assert_close(a.logprobs, b.logprobs, n=TERMS)
    assert a.finish_reason == b.finish_reason


def assert_all_free(e):
  assert not e.has_work and not len(e.park)
  assert e.allocator.num_free == e.allocator.num_pages
  assert e.ring_allocator.num_free == e.ring_allocator.num_pages


def test_the_window_layers_pool_holds_a_ring_per_running_request(rings):
  e = rings
  assert e.ring_pages == 4 == ring_size(5, 4, e.cfg)
  pools = [k.shape[1] for k, _ in e._kv]
  # Layer 2 attends to every position; each of data's 2 shards has pools of its own.
  assert pools == [2 * 4 * 6, 2 * 4 * 6, 2 * 96, 2 * 4 * 6]
  # Off, or a ring no smaller than the longest sequence: one pool for every layer.
  config = lambda **c: PagedConfig(**{**SMALL, **c})  # noqa: E731
  assert window_pool(config(window_pages=0), MODEL.config) == (0, 0)
  assert window_pool(config(max_tokens=16), MODEL.config) == (0, 0)
  assert window_pool(config(max_tokens=17), MODEL.config) == (4, 24)
  assert window_pool(config(window_pages=5), MODEL.config) == (4, 5)
  plain = Model(get_preset("tiny"))
  assert window_pool(PagedConfig(**SMALL), plain.config) == (0, 0)
  np.testing.assert_array_equal(ring_table([[7, 8, 9], None], 3, 5)[:2], [[7, 8, 9, 7, 8], [0] * 5])


def test_bad_window_pool_sizes_are_refused(mesh, params):
  with pytest.raises(ValueError, match="window_pages=3 cannot hold one request's ring of 4"):
    engine(mesh, params, window_pages=3)
  with pytest.raises(ValueError, match="window_pages must be -1"):
    PagedConfig(window_pages=-2)


@pytest.mark.parametrize("pack_prefill", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_rings_give_the_tokens_of_one_pool(mesh, params, one_pool, pack_prefill):
  """Greedy, prompts from 1 to 30 tokens (packed rows and chunks of 8 that read back across
  the ring), responses that go round it several times. (One pool against transformers, and
  rings in the default engine of `hf_checkpoints.paged_greedy`: tests/model/hf_test.py.)"""
  rng = np.random.default_rng()
  ps = prompts(rng, [1, 4, 9, 13, 22, 30, 6, 17])
  sp = SamplingParams(temperature=0.0, max_new_tokens=28, ignore_eos=True)
  assert one_pool.ring_pages == 0
  rings = engine(mesh, params, pack_prefill=pack_prefill)
  assert_same(rings.generate(ps, sp, seed=0), one_pool.generate(ps, sp, seed=0))
  assert_all_free(rings)


def test_shared_prompts_copy_the_leaders_ring(mesh, params, one_pool):
  """Four samples of each prompt: the followers copy the leader's ring after its prefill and
  draw what one pool's engine draws (same seeds)."""
  rng = np.random.default_rng()
  ps = [p for p in prompts(rng, [7, 19]) for _ in range(4)]
  sp = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
  shared = engine(mesh, params, max_running=8)
  got = shared.generate(ps, sp, seed=3)
  assert shared.num_shared_prefill_tokens == 3 * (6 + 18)
  assert_same(got, one_pool.generate(ps, sp, seed=3))
  assert_all_free(shared)


def test_preempted_requests_resume_on_a_new_ring(mesh, params, one_pool):
  rng = np.random.default_rng()
  ps = prompts(rng, [3, 11, 5, 14, 8, 2])
  sp = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
  # 24 pages of 4 cannot hold 6 requests of up to 43 tokens in the global layer.
  small = engine(mesh, params, num_pages=24)
  got = small.generate(ps, sp, seed=5)
  assert small.num_preemptions > 0
  assert_same(got, one_pool.generate(ps, sp, seed=5))
  assert_all_free(small)


def test_one_ring_runs_one_request_at_a_time(mesh, params, one_pool):
  rng = np.random.default_rng()
  ps = prompts(rng, [3, 10, 6])
  sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
  e = engine(mesh, params, window_pages=4)
  got = e.generate(ps, sp, seed=0)
  # One request at a time on each of data's 2 shards (a ring each): 4 windows of 3 steps for
  # the first two requests, then 4 for the third.
  assert e.num_windows >= 2 * 4
  assert_same(got, one_pool.generate(ps, sp, seed=0))
  assert_all_free(e)


def test_a_next_turn_reads_its_parked_ring(mesh, params):
  """A kept turn's ring is parked with its pages: the next turn prefills only its new tokens
  (in chunks that read the parked ring) and samples what a full prefill samples."""
  rng = np.random.default_rng()
  sampling = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True)
  firsts = dict(zip("ab", prompts(rng, [6, 15]), strict=True))
  answers = dict(zip("ab", prompts(rng, [10, 3]), strict=True))  # the environment's
  turns = {}
  for keep in (True, False):
    e = engine(mesh, params, keep_turn_kv=keep, window_pages=-1 if keep else 0)
    for i, (rid, p) in enumerate(firsts.items()):
      e.submit(RequestRecord(rid, p, sampling, seed=i, keep_kv=True))
    first = {r.request_id: r for r in e.stream()}
    assert len(e.park) == (2 if keep else 0)
    for i, rid in enumerate("ab"):
      history = first[rid].prompt_ids + first[rid].token_ids + answers[rid]
      e.submit(RequestRecord(rid, history, sampling, seed=10 + i, keep_kv=True))
    second = {r.request_id: r for r in e.stream()}
    if keep:
      assert e.num_kept_prefill_tokens == sum(first[r].num_tokens - 1 for r in "ab")
      e.drain()  # drops what the second turns parked
      assert_all_free(e)
    turns[keep] = [r for rid in "ab" for r in (first[rid], second[rid])]
  for a, b in zip(turns[True], turns[False], strict=True):
    assert a.token_ids == b.token_ids
    tolerance.assert_close(np.asarray(a.logprobs), np.asarray(b.logprobs), n=TERMS)


def test_a_snapshot_continues_on_another_engine_exactly(mesh, params, rings):
  rng = np.random.default_rng()
  ps = prompts(rng, [5, 12])
  sp = SamplingParams(temperature=1.0, max_new_tokens=26, ignore_eos=True)
  expected = rings.generate(ps, sp, seed=2)
  first = rings
  ids = [first.submit(p, sp, seed=(2 * 1_000_003 + i) % (2**31 - 1)) for i, p in enumerate(ps)]
  for _ in range(4):
    first.step()
  records = first.abort(ids)
  assert all(0 < len(r.token_ids) < 26 for r in records)
  assert_all_free(first)
  second = engine(mesh, params, decode_steps=2)
  for r in records:
    second.submit(r)
  done = {r.request_id: r for r in second.stream()}
  for i, want in zip(ids, expected, strict=True):
    np.testing.assert_array_equal(done[i].token_ids, want.token_ids)


def test_precompiled_ring_engine_compiles_nothing_while_it_generates(mesh, params, one_pool):
  """Its decode windows, prefills and copies of both pools' pages are all precompiled."""
  rng = np.random.default_rng()
  # 2 rows on each of data's 2 shards: a prompt's second sample joins its leader's shard.
  e = engine(mesh, params, precompile=True, max_tokens=40, max_running=4)
  compiled = lambda: [e._calls.compiled(f) for f in e._calls.jitted]  # noqa: E731
  before = compiled()
  ps = [p for p in prompts(rng, [6, 20]) for _ in range(2)]  # shared prompts: rings copied
  sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
  got = e.generate(ps, sp, seed=0)
  assert compiled() == before and e.num_shared_prefill_tokens > 0
  assert_same(got, one_pool.generate(ps, sp, seed=0))


@pytest.mark.parametrize(
  "window, page_size, steps, chunk", [(5, 4, 3, 8), (16, 16, 1, 1), (512, 16, 8, 128), (7, 2, 8, 3)]
)
def test_ring_size_is_the_fewest_pages_no_call_overwrites_a_page_it_still_reads(
  window, page_size, steps, chunk
):
  """Simulated on positions alone: each call of a request (a decode window of `steps` tokens,
  or a prefill chunk) writes its positions in order, each after reading the window of the one
  before (so a write may not replace a page a later query of the call, or a later call,
  reads); with the ring of `ring_size`, no read finds a page that holds another logical page,
  and one page fewer fails."""
  config = PagedConfig(page_size=page_size, decode_steps=steps, prefill_chunk=chunk)
  ring = ring_size(window, page_size, config)

  def broken(ring_pages: int) -> bool:
    for start, width in itertools.product(range(window + 2 * page_size), (steps, chunk)):
      holds = {}  # ring slot -> logical page it holds now
      for p in range(start):  # everything before the call, written in order
        holds[(p // page_size) % ring_pages] = p // page_size
      for q in range(start, start + width):  # the call: write q, then read q's window
        holds[(q // page_size) % ring_pages] = q // page_size
      reads = range(max(0, start - window + 1), start + width)  # what the call's queries read
      if any(holds[(k // page_size) % ring_pages] != k // page_size for k in reads):
        return True
    return False

  assert not broken(ring) and broken(ring - 1)
