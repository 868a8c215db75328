"""Kept turn KV (`kv_park`): a request's next turn reuses its parked pages and samples exactly
what a full prefill gives; parked pages yield to work and to new weights."""

import jax
import numpy as np
import pytest
from helpers.paged_engines import MODEL, engine

from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.sharding import make_mesh


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(jax.devices()[:2], {"data": 2})


def turn(rid, tokens, seed, new=8, temperature=1.0):
  sampling = SamplingParams(temperature=temperature, max_new_tokens=new, ignore_eos=True)
  return RequestRecord(rid, [int(t) for t in tokens], sampling, seed=seed, keep_kv=True)


def run(e, records):
  for r in records:
    e.submit(r)
  return {r.request_id: r for r in e.stream()}


# Greedy is `slow`: sampled turns (the same seeds with and without kept pages) give the same
# tokens only if the kept pages give the same logits, as greedy ones do.
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_a_next_turn_on_kept_pages_samples_what_a_full_prefill_samples(mesh, params, temperature):
  rng = np.random.default_rng()
  # Pages of 4 and chunks of 8: kept pages end mid-page (copied) and the new tokens take
  # several chunks, which start past the kept positions.
  small = dict(page_size=4, num_pages=64, prefill_chunk=8, decode_steps=3)
  prompts = {rid: rng.integers(3, 60, int(rng.integers(3, 14))) for rid in "abc"}
  extras = {rid: list(rng.integers(3, 60, int(rng.integers(1, 20)))) for rid in "abc"}
  turns, kept = {}, {}
  for keep in (True, False):
    e = engine(mesh, params, keep_turn_kv=keep, **small)
    first = run(e, [turn(rid, p, i, temperature=temperature) for i, (rid, p) in
                    enumerate(prompts.items())])  # fmt: skip
    assert len(e.park) == (3 if keep else 0)
    seconds = []
    for i, rid in enumerate("abc"):
      tokens = [*first[rid].prompt_ids, *first[rid].token_ids, *extras[rid]]
      if rid == "c":  # a changed history: its kept pages must not be used
        tokens[1] = 3 + tokens[1] % 57
      seconds.append(turn(rid, tokens, 10 + i, temperature=temperature))
    second = run(e, seconds)
    turns[keep] = [r for rid in "abc" for r in (first[rid], second[rid])]
    kept[keep] = e.num_kept_prefill_tokens
    assert not e.has_work and e.allocator.num_free + e.park.num_pages == e.allocator.num_pages
  for a, b in zip(turns[True], turns[False], strict=True):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
  # a and b reused every cached token of their first turn (all but its last); c none.
  first_a, first_b = turns[True][0], turns[True][2]
  assert kept == {True: first_a.num_tokens - 1 + first_b.num_tokens - 1, False: 0}


def test_a_next_turn_sharing_a_leaders_pages_counts_its_tokens_once(mesh, params):
  """Two trajectories with the same history (greedy): the second turn of the one admitted
  second shares the first's pages and drops its own parked ones, so its tokens count as
  shared, not as kept too: every cached token is prefilled, kept or shared exactly once."""
  e = engine(mesh, params, page_size=4, num_pages=64, decode_steps=2)
  first = run(e, [turn(rid, [5, 6, 7, 8, 9, 10], 0, new=5, temperature=0.0) for rid in "ab"])
  assert first["a"].token_ids == first["b"].token_ids and len(e.park) == 2
  tokens = [*first["a"].prompt_ids, *first["a"].token_ids, 11, 12]
  before = e.num_prefill_tokens
  second = run(e, [turn(rid, tokens, 1, new=5, temperature=0.0) for rid in "ab"])
  assert second["a"].token_ids == second["b"].token_ids
  assert e.num_kept_prefill_tokens == 10  # a's first turn cached 10 of its 12 tokens
  assert e.num_shared_prefill_tokens == 5 + 12  # b's prompt in turn 1, its tokens in turn 2
  assert e.num_prefill_tokens - before == 2  # a's two new tokens
  e.drain()  # frees the parked pages (the two entries share their whole pages)
  assert e.allocator.num_free == e.allocator.num_pages


def test_parked_pages_are_evicted_before_any_request_is_preempted(params):
  mesh = make_mesh(jax.devices()[:1], {"data": 1})  # one pool: on `data` 2, each has its own
  rng = np.random.default_rng()
  # 12 pages of 4: turn 1 parks 5 pages; two new requests of 24 tokens need all 12.
  small = dict(page_size=4, num_pages=12, prefill_chunk=8, decode_steps=2)
  a = turn("a", rng.integers(3, 60, 10), 0, new=10)
  others = [turn(rid, rng.integers(3, 60, 10), i, new=14) for i, rid in enumerate("xy", 1)]
  out = {}
  for keep in (True, False):
    e = engine(mesh, params, keep_turn_kv=keep, **small)
    first = run(e, [RequestRecord.from_dict(a.to_dict())])["a"]
    assert len(e.park) == int(keep) and e.park.num_pages == (5 if keep else 0)
    done = run(e, [RequestRecord.from_dict(r.to_dict()) for r in others])
    assert e.num_preemptions == 0
    # a's 5 pages made room; x and y (done) are parked now, on the 12 pages they used.
    assert e.park.num_evicted_pages == (5 if keep else 0) and "a" not in e.park
    again = run(e, [turn("a", [*first.prompt_ids, *first.token_ids, 7, 8], 1)])["a"]
    assert e.num_kept_prefill_tokens == 0  # evicted: prefilled in full
    assert e.allocator.num_free + e.park.num_pages == 12
    out[keep] = [first, done["x"], done["y"], again]
  for p, q in zip(out[True], out[False], strict=True):
    assert p.token_ids == q.token_ids
    np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=1e-5)


def test_new_weights_drop_parked_pages_and_pages_of_older_weights_are_not_parked(mesh, params):
  rng = np.random.default_rng()
  e = engine(mesh, params, page_size=4, num_pages=16, decode_steps=2)  # 16 on each of 2 shards
  first = run(e, [turn("a", rng.integers(3, 60, 9), 0)])["a"]
  assert "a" in e.park
  e.update_weights(MODEL.init(int(rng.integers(1 << 16))), 1)
  assert len(e.park) == 0 and e.allocator.num_free == e.allocator.num_pages
  second = run(e, [turn("a", [*first.prompt_ids, *first.token_ids, 5, 6], 1)])["a"]
  assert e.num_kept_prefill_tokens == 0 and set(second.versions) == {1}
  # Weights that change while a turn runs: its pages mix versions and are not kept.
  e.submit(turn("b", rng.integers(3, 60, 9), 2, new=12))
  e.step()
  e.update_weights(params, 2)
  list(e.stream())
  assert "b" not in e.park and len(e.park) == 0
  # An ended episode's pages go at once; so do all on drain.
  run(e, [turn("c", rng.integers(3, 60, 9), 3)])
  assert "c" in e.park and e.allocator.num_free < e.allocator.num_pages
  assert e.drop_kept("c") and not e.drop_kept("c") and e.allocator.num_free == e.allocator.num_pages
  run(e, [turn("d", rng.integers(3, 60, 9), 4)])
  assert "d" in e.park
  e.drain()
  assert len(e.park) == 0 and e.allocator.num_free == e.allocator.num_pages


def test_keep_kv_round_trips_and_old_records_load_without_it():
  r = turn("a", [5, 6, 7], 3)
  assert RequestRecord.from_dict(r.to_dict()).keep_kv is True
  old = r.to_dict()
  del old["keep_kv"]
  assert RequestRecord.from_dict(old).keep_kv is False


def test_a_next_turn_filling_the_pool_is_not_held_up_by_its_own_parked_pages(mesh, params):
  """Admitting a next turn holds its parked pages until the allocation: where its tokens fill
  the pool exactly, those pages are given up and the turn prefilled whole."""
  e = engine(mesh, params, page_size=4, num_pages=4, decode_steps=4)
  first = run(e, [turn("t", [5, 6, 7, 8, 9], seed=0, new=2)])["t"]
  assert e.park.num_pages == 2  # 6 cached tokens: a whole page and a partial one
  tokens = first.prompt_ids + first.token_ids + [11] * (15 - first.num_tokens)
  second = run(e, [turn("t", tokens, seed=1, new=1)])["t"]  # 15 tokens cached: the 4 pages
  assert second.finish_reason == "length" and len(second.token_ids) == 1
  unkept = engine(mesh, params, page_size=4, num_pages=4, keep_turn_kv=False)
  again = run(unkept, [turn("t", tokens, seed=1, new=1)])["t"]
  assert again.token_ids == second.token_ids


def test_a_precompiled_engine_compiles_nothing_for_a_next_turn_on_kept_pages(mesh, params):
  """Sequences that fit one packed prefill row still meet the chunked prefill as a next turn
  (its new tokens after the kept pages), and a kept page filled part-way is copied:
  precompile covers both when turns keep their pages."""
  rng = np.random.default_rng()
  small = dict(page_size=4, num_pages=64, prefill_chunk=32, decode_steps=2, max_running=2)
  e = engine(mesh, params, precompile=True, max_tokens=32, **small)

  def compiled():  # decode windows, prefills, page copies; the last, every program's shapes
    return [*(e._calls.compiled(f) for f in e._calls.jitted), e._calls.compiled()]

  before = compiled()
  first = run(e, [turn("a", rng.integers(3, 60, 6), 0, new=4)])["a"]  # caches 9: 2 pages + 1
  tokens = [*first.prompt_ids, *first.token_ids, *rng.integers(3, 60, 6)]
  run(e, [turn("a", tokens, 1, new=4)])
  assert e.num_kept_prefill_tokens > 0
  assert compiled() == before
