"""Packed prefill: ragged prompts share rows, and the engine caches and samples as unpacked."""

import jax
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import Model, get_preset
from jaxrl.rollout import SamplingParams
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.prefill import pack_rows, packed_call
from jaxrl.sharding import ROLLOUT_RULES, make_mesh

EOS, PAD = 2, 0
MODEL = Model(get_preset("tiny"))


def test_pack_rows_places_each_sequence_once_within_the_width():
  rng = np.random.default_rng()
  lengths = list(rng.integers(1, 33, 40))
  rows = pack_rows(lengths, 32)
  assert sorted(i for row in rows for i in row) == list(range(40))
  assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
  # First fit decreasing: no two rows could be merged.
  fills = sorted(sum(lengths[i] for i in row) for row in rows)
  assert len(fills) < 2 or fills[0] + fills[1] > 32
  with pytest.raises(ValueError, match="every length must be in 1..32"):
    pack_rows([5, 33], 32)


def test_packed_call_writes_each_token_to_its_own_requests_page():
  seqs = [[7, 8, 9, 10, 11], [20, 21, 22], [30, 31]]  # caches 4, 2 and 1 tokens
  pages = [[5, 6], [9], [3]]
  call = packed_call(seqs, pages, rows=2, width=4, page_size=2, num_pages=16, pad_id=0)
  assert call.tokens_bt.tolist() == [[7, 8, 9, 10], [20, 21, 30, 0]]
  assert call.positions_bt.tolist() == [[0, 1, 2, 3], [0, 1, 0, -1]]
  assert call.segment_ids_bt.tolist() == [[0, 0, 0, 0], [0, 0, 1, -1]]
  assert call.token_pages_bt.tolist() == [[5, 5, 6, 6], [9, 9, 3, 16]]
  with pytest.raises(ValueError, match="2 rows needed, 1 given"):
    packed_call(seqs, pages, rows=1, width=4, page_size=2, num_pages=16, pad_id=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_packed_prefill_gives_the_cache_and_tokens_of_one_request_per_row(temperature):
  """Ragged prompts (1 to 30 tokens) prefilled packed fill the same pages with the same keys
  and values as one request per row, in fewer rows, and the tokens sampled after are the same;
  so do both kinds cut into calls of at most `prefill_tokens` (a row a call, packed; two
  prompts a call, one to a row)."""
  mesh = make_mesh(jax.devices()[:2], {"data": 2})
  params = MODEL.init(1)
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(3, 60, n)) for n in rng.integers(1, 31, 12)]
  sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
  ways = [(False, 4096), (True, 4096), (True, 32), (False, 64)]  # (pack_prefill, prefill_tokens)
  engines, rows = [], []
  for pack, budget in ways:
    config = PagedConfig(
      page_size=8, num_pages=64, max_running=16, prefill_chunk=32, pack_prefill=pack,
      prefill_tokens=budget,
    )  # fmt: skip
    e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config)
    e.update_weights(params, 0)
    calls = e._calls.prefill_packed if pack else e._calls.prefill
    seen = []
    record = lambda *args, calls=calls, seen=seen: seen.append(args[2].shape) or calls(*args)  # noqa: E731
    if pack:
      e._calls.prefill_packed = record
    else:
      e._calls.prefill = record
    for i, p in enumerate(prompts):
      e.submit(p, sampling, request_id=str(i), seed=i)
    e._admit()  # prefill only
    engines.append(e)
    rows.append(seen)
  assert len(rows[1]) == 1 and rows[1][0][0] < rows[0][0][0]  # one call, fewer rows

  # Each request's row on its shard's device of `data` 2 (its pages are there), so a call
  # has a row of each shard's at least: a packed row of each a call, as many calls as the
  # most packed rows of a shard; one prompt to a row, one of each shard's a call (a 1-token
  # prompt caches nothing).
  def on_shard(e, shard):
    return [
      len(p) - 1 for i, p in enumerate(prompts) if len(p) > 1 and e.running[str(i)].shard == shard
    ]

  assert rows[2] == [(2, 32)] * max(len(pack_rows(on_shard(engines[2], s), 32)) for s in (0, 1))
  assert rows[3] == [(2, 32)] * max(len(on_shard(engines[3], s)) for s in (0, 1))
  terms = tolerance.model_terms(MODEL.config)
  unpacked = engines[0]
  for other in engines[1:]:
    for i in range(len(prompts)):
      a, b = unpacked.running[str(i)], other.running[str(i)]
      cached = len(prompts[i]) - 1
      for (ka, va), (kb, vb) in zip(unpacked._kv, other._kv, strict=True):
        for x, y in ((ka, kb), (va, vb)):
          xa = np.asarray(x)[:, a.pages].reshape(x.shape[0], -1, x.shape[-1])[:, :cached]
          xb = np.asarray(y)[:, b.pages].reshape(y.shape[0], -1, y.shape[-1])[:, :cached]
          tolerance.assert_close(xb, xa, n=terms)
  done = [{r.request_id: r for r in e.stream()} for e in engines]
  for other in done[1:]:
    for i in range(len(prompts)):
      a, b = done[0][str(i)], other[str(i)]
      assert a.token_ids == b.token_ids
      tolerance.assert_close(np.asarray(b.logprobs), np.asarray(a.logprobs), n=terms)
