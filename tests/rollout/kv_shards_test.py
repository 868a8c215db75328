"""A paged engine whose rows split over several devices splits its KV pool with them: each
device holds `num_pages` pages of its own rows, so the engine holds as many more tokens as it
has devices along `data` (before, every device held the whole pool, and wrote every token)."""

import jax
import numpy as np
import pytest
from helpers import tolerance
from helpers.paged_engines import EOS, MODEL, PAD, engine
from jax.sharding import PartitionSpec as P

from jaxrl.rollout import SamplingParams
from jaxrl.rollout.decode_loop import DecodeState, DeviceBatch, RowSampling, RowStart
from jaxrl.rollout.kv_park import KVPark, Parked
from jaxrl.rollout.requests import PageAllocator
from jaxrl.sharding import ROLLOUT_RULES, batch_sharding, make_mesh

TERMS = tolerance.model_terms(MODEL.config)


def test_parked_pages_are_evicted_only_from_the_shard_short_of_pages():
  allocator = PageAllocator(4, shards=2)
  park = KVPark(allocator)
  for rid, shard in (("old", 1), ("mid", 0), ("new", 1)):
    park.park(rid, Parked((1, 2, 3), allocator.allocate(2, shard), []))
  assert allocator.num_free == 2 and park.shard_of(park._entries["mid"]) == 0
  # Shard 0 needs 3 pages: only "mid" is on it; the older "old" of shard 1 stays.
  assert sorted(park.allocate(3, shard=0)) == [0, 1, 2]
  assert list(park._entries) == ["old", "new"] and park.num_evicted_pages == 2
  assert park.allocate(3, shard=0) is None and list(park._entries) == ["old", "new"]
  assert park.allocate(4, shard=1) is not None and len(park) == 0


def test_device_batch_keeps_each_request_in_its_shards_rows():
  mesh = make_mesh(jax.devices()[:2], {"data": 2})
  row = batch_sharding(mesh, ROLLOUT_RULES, 1)
  matrix = batch_sharding(mesh, ROLLOUT_RULES, 2)
  batch = DeviceBatch(
    (DecodeState(*[row] * 5), RowSampling(row, row, row, row, matrix)), PAD, shards=2, max_rows=8
  )
  start = RowStart(token=5, position=3, budget=4, index=0, seed=1, temperature=1.0, top_k=0,
                   top_p=1.0, stop_ids=(EOS,))  # fmt: skip

  def holders(*shards):
    return [type("H", (), {"shard": s, "row": -1})() for s in shards]

  first = holders(1, 1, 0)
  batch.place([], [(h, start) for h in first], rows=4, stop_width=1)
  assert [h.row for h in first] == [2, 3, 0]  # shard 1: rows 2-3; shard 0: rows 0-1
  more = holders(1, 0)
  batch.place(first, [(h, start) for h in more], rows=8, stop_width=1)  # re-laid out: 4 a shard
  assert [h.row for h in first] == [4, 5, 0] and [h.row for h in more] == [6, 1]
  assert np.asarray(batch.state.positions_b).tolist() == [3, 3, -1, -1, 3, 3, 3, -1]
  with pytest.raises(ValueError, match="no free row in shard 1's 4 rows"):
    batch.place([*first, *more], [(h, start) for h in holders(1, 1)], rows=8, stop_width=1)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_re_layout_between_two_smaller_row_counts_passes_through_the_largest(shards):
  """A batch that grows from 2 to 4 rows a shard with 8 the largest moves its rows through 8
  (one program into and one out of the largest row count, not one per pair of counts); each
  row keeps its state, and the largest count is re-laid out into in one gather."""
  mesh = make_mesh(jax.devices()[:shards], {"data": shards})
  row = batch_sharding(mesh, ROLLOUT_RULES, 1)
  matrix = batch_sharding(mesh, ROLLOUT_RULES, 2)
  ran = []  # (program, rows in, rows out) of each gather
  batch = DeviceBatch(
    (DecodeState(*[row] * 5), RowSampling(row, row, row, row, matrix)), PAD, shards=shards,
    max_rows=8 * shards,
    note=lambda jitted, args: ran.append((jitted, args[0].positions_b.shape[0], args[2].shape[0])),
  )  # fmt: skip

  def holders(n, first_position):
    made = [type("H", (), {"shard": i % shards, "row": -1})() for i in range(n)]
    starts = [
      RowStart(
        token=5,
        position=first_position + i,
        budget=4,
        index=0,
        seed=i,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        stop_ids=(EOS,),
      )  # fmt: skip
      for i in range(n)
    ]
    return made, list(zip(made, starts, strict=True))

  first, new = holders(2 * shards, 10)
  batch.place([], new, rows=2 * shards, stop_width=4)
  more, new = holders(2 * shards, 20)
  batch.place(first, new, rows=4 * shards, stop_width=4)
  gathers = [(into, out) for jitted, into, out in ran if jitted is batch._gather_rows]
  assert gathers == [(2 * shards, 8 * shards), (8 * shards, 4 * shards)]
  positions = np.asarray(batch.state.positions_b)
  for i, h in enumerate(first):
    assert positions[h.row] == 10 + i and batch.rows[h.row] is h
  for i, h in enumerate(more):
    assert positions[h.row] == 20 + i and batch.rows[h.row] is h
  assert (positions >= 0).sum() == 4 * shards  # the rest dead
  ran.clear()
  last, new = holders(2 * shards, 30)
  batch.place([*first, *more], new, rows=8 * shards, stop_width=4)  # into the largest: one
  gathers = [(into, out) for jitted, into, out in ran if jitted is batch._gather_rows]
  assert gathers == [(4 * shards, 8 * shards)]
  positions = np.asarray(batch.state.positions_b)
  assert sorted(positions[h.row] for h in [*first, *more, *last]) == sorted(
    [*range(10, 10 + 2 * shards), *range(20, 20 + 2 * shards), *range(30, 30 + 2 * shards)]
  )


def test_an_engine_over_data_holds_a_pool_on_each_device(params):
  """The same `num_pages` on one device preempts; over `data` 2 the requests fit in the two
  devices' pools, and give the same tokens. Every running request's row and pages are on
  one shard's devices."""
  rng = np.random.default_rng()
  ps = [list(rng.integers(3, 60, int(rng.integers(4, 12)))) for _ in range(8)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
  # 8 requests of up to 31 tokens need up to 32 pages of 8: one device's 16 do not hold them,
  # two devices' do (4 requests on each).
  small = dict(page_size=8, num_pages=16, max_running=8, prefill_chunk=8, decode_steps=2)
  one = engine(make_mesh(jax.devices()[:2], {"tensor": 2}), params, **small)
  expected = one.generate(ps, sp, seed=0)
  assert one.num_preemptions > 0
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
  e = engine(mesh, params, **small)
  assert e.shards == 2 and e.allocator.num_pages == 32
  assert e._kv[0][0].sharding.spec == P("tensor", "data", None, None)
  assert e._kv[0][0].shape[1] == 32
  for i, p in enumerate(ps):
    e.submit(p, sp, seed=(0 * 1_000_003 + i) % (2**31 - 1), request_id=str(i))
  done, checked = {}, 0
  while e.has_work:
    for r in e.step():
      done[r.request_id] = r
    block = len(e._batch.rows) // 2
    for s in e.running.values():
      assert {page // 16 for page in s.pages} == {s.shard} and s.row // block == s.shard
      checked += 1
  assert checked > 0 and e.num_preemptions == 0
  assert {s for s in range(2) if e.allocator.free_in(s) == 16} == {0, 1}
  for i, want in enumerate(expected):
    np.testing.assert_array_equal(done[str(i)].token_ids, want.token_ids)
    tolerance.assert_close(done[str(i)].logprobs, want.logprobs, n=TERMS)


def test_a_group_split_over_shards_prefills_its_prompt_once_on_each(params):
  """4 samples of one prompt, 2 rows a shard: two on each of data's 2 shards, the second of
  each sharing the first's pages; the tokens are those of unshared requests."""
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
  prompt = list(np.random.default_rng().integers(3, 60, 13))
  sp = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
  runs = {}
  for share in (True, False):
    e = engine(mesh, params, page_size=4, num_pages=16, max_running=4, share_prefix=share)
    runs[share] = e.generate([prompt] * 4, sp, seed=3)
    if share:
      assert e.num_shared_prefill_tokens == 2 * 12 and e.num_prefill_tokens == 2 * 12
  for a, b in zip(runs[True], runs[False], strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    tolerance.assert_close(a.logprobs, b.logprobs, n=TERMS)
