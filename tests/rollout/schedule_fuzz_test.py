"""Random schedules on the paged engine: whatever happens to a request on its way, it ends with
the tokens a roomy engine gives it.

Each run draws an engine (page size, a pool of a few sequences, rows, prefill chunk, window,
prefix sharing, kept turn KV, packed prefill, shapes sized ahead), requests of every kind of
sampling (greedy, temperatures, top-k, top-p, stop tokens), and a schedule of operations
between its steps:
GRPO-like groups submitted, requests snapshotted and continued on the same engine or moved to a
second one (sharing flipped), requests aborted for good, next turns of finished multi-turn
requests, and new weights (the same values under a new version: parked pages must go, tokens
must not change). The pool is small, so preemption and eviction of parked pages happen too.
MoE models run with the reference dispatch on the data 2 x tensor 2 mesh, and with the
expert-parallel layer: over an expert axis, and grouped on one device's experts.

Sampled tokens depend only on a request's seed, its position and the logits, so every
request's tokens (and MoE routes) must equal those a roomy engine gives it from its first
prompt, and its log-probs theirs to rounding; an aborted request's partial tokens are a prefix
of them; its tokens' weight versions never go down; nothing is lost or returned twice; every
page is free at the end. (MoE: up to a router near-tie, an input whose k-th and next best
experts are within float32 rounding, where two right runs may route, and then sample, apart.)

A failing run names its seed: `JAXRL_SCHEDULE_SEED=<seed>` replays it.
"""

import dataclasses
import json
import math
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.paged_engines import MODEL, engine

from jaxrl.model import Model, get_preset, moe
from jaxrl.model.moe import route as moe_route
from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.sharding import make_mesh

MOE = Model(get_preset("tiny-moe"))
MODELS = {
  "dense": MODEL,
  "moe": MOE,
  # Three of four layers with a window of 5 positions: their own ring pool (`window_kv`).
  "window": Model(
    get_preset(
      "tiny", num_layers=4, sliding_window=5, sliding_layers=(0, 1, 3), local_rope_theta=100.0
    )
  ),
  # The expert-parallel layer (`jaxrl.sharding.moe_expert_parallel`): experts over an expert
  # axis, and grouped matmuls over one device's experts.
  "moe-expert": MOE,
  "moe-grouped": Model(get_preset("tiny-moe", moe_dispatch="grouped")),
}
# Kinds run on a mesh of their own, not the data 2 x tensor 2 one.
MESHES = {"moe-expert": {"data": 2, "expert": 2}, "moe-grouped": {"data": 2}}
LONGEST_PROMPT, MOST_NEW = 30, 20  # a request of 50 tokens must fit one device's pool
# The reference: every request admitted at once, nothing shared, kept or preempted.
ROOMY = dict(page_size=8, num_pages=256, max_running=64, prefill_chunk=64, decode_steps=1)


def copied(record: RequestRecord) -> RequestRecord:
  """The record as a checkpoint or another process would hand it back."""
  return RequestRecord.from_dict(json.loads(json.dumps(record.to_dict())))


class Schedule:
  """One random run: the engine under test, a second one that takes moved requests, and what
  each request must end as."""

  def __init__(self, model, mesh, params, rng):
    self.rng = rng
    self.params = params
    page_size = int(rng.choice([2, 4, 8]))
    self.cfg = dict(
      page_size=page_size,
      num_pages=-(-(LONGEST_PROMPT + MOST_NEW) // page_size) + int(rng.integers(0, 6)),
      max_running=int(rng.choice([2, 4, 8])),
      prefill_chunk=int(rng.choice([4, 8, 16])),
      decode_steps=int(rng.integers(1, 4)),
      share_prefix=bool(rng.random() < 0.7),
      keep_turn_kv=bool(rng.random() < 0.5),
      pack_prefill=bool(rng.random() < 0.7),
      max_tokens=int(rng.choice([0, 0, 64])),  # 64: every table and chunk sized for 64 tokens
    )
    flipped = {**self.cfg, "share_prefix": not self.cfg["share_prefix"]}
    self.engines = [engine(mesh, params, model=model, **c) for c in (self.cfg, flipped)]
    self.model, self.version = model, 0
    self.first = {}  # request id -> its record as first submitted (this turn)
    self.done = {}  # request id -> its finished record (this turn)
    self.aborted = {}  # request id -> its partial record, not continued
    self.earlier_turns = []  # (first record, finished record) of turns a next turn followed
    self.ids = iter(range(1 << 30))

  def new_request(self, prompt, rid=None, keep=False) -> RequestRecord:
    rng = self.rng
    # Rows that filter change the sampler a whole call runs (`filter_width`), which must not
    # change the tokens of the rows beside them.
    sampling = SamplingParams(
      temperature=float(rng.choice([0.0, 1.0, 1.0, 0.7])),
      top_k=int(rng.choice([0, 0, 0, 5, 80])),
      top_p=float(rng.choice([1.0, 1.0, 0.9])),
      max_new_tokens=int(rng.integers(1, MOST_NEW + 1)),
      stop_token_ids=tuple(int(t) for t in rng.integers(3, 60, int(rng.choice([0, 0, 1, 2])))),
      ignore_eos=bool(rng.random() < 0.5),
    )
    rid = rid or f"q{next(self.ids)}"
    return RequestRecord(rid, prompt, sampling, seed=int(rng.integers(1 << 30)), keep_kv=keep)

  def submit(self, record):
    self.first[record.request_id] = copied(record)
    self.engines[0].submit(record)

  def finished(self, record):
    rid = record.request_id
    assert rid not in self.done, f"{rid} returned twice"
    self.done[rid] = record

  def act(self):
    """One random operation."""
    rng, main = self.rng, self.engines[0]
    r = rng.random()
    held = [*main.running, *(w.request_id for w in main.waiting)]
    if r < 0.25:  # a group of G responses to one prompt
      prompt = [int(t) for t in rng.integers(3, 60, int(rng.integers(1, LONGEST_PROMPT + 1)))]
      keep = self.cfg["keep_turn_kv"] and rng.random() < 0.5
      for _ in range(int(rng.choice([1, 1, 2, 4]))):
        self.submit(self.new_request(prompt, keep=keep))
    elif r < 0.33 and held:  # stopped mid-run: dropped, continued here, or moved
      part = main.snapshot(str(rng.choice(held)))
      if part.finish_reason is not None:  # it finished in the window in flight
        self.finished(part)
      elif rng.random() < 0.3:
        self.aborted[part.request_id] = part
      else:
        self.engines[int(rng.integers(2))].submit(copied(part))
    elif r < 0.39:  # the next turn of a finished multi-turn request
      kept = sorted(rid for rid, d in self.done.items() if d.keep_kv)
      if kept:
        rid = str(rng.choice(kept))
        d = self.done.pop(rid)
        answer = [int(t) for t in rng.integers(3, 60, int(rng.integers(1, 8)))]
        history = [*d.prompt_ids, *d.token_ids, *answer]
        if len(history) <= LONGEST_PROMPT:
          self.earlier_turns.append((self.first.pop(rid), d))
          self.submit(self.new_request(history, rid=rid, keep=True))
        else:
          self.done[rid] = d
    elif r < 0.42:  # new weights (the same values) to both: parked pages go, tokens stay
      self.version += 1
      for e in self.engines:
        e.update_weights(self.params, self.version)

  def run(self, operations):
    for _ in range(operations):
      self.act()
      for e in self.engines:
        if e.has_work:
          for record in e.step():
            self.finished(record)
    for e in self.engines:
      while e.has_work:
        for record in e.step():
          self.finished(record)

  def check(self, mesh):
    """Every request's tokens against the roomy engine's, and every page free."""
    pairs = [(first, self.done.get(rid) or self.aborted.get(rid)) for rid, first in
             self.first.items()] + self.earlier_turns  # fmt: skip
    for first, got in pairs:
      assert got is not None, f"{first.request_id} was lost"
    roomy = engine(mesh, self.params, model=self.model, **ROOMY)
    for i, (first, _) in enumerate(pairs):
      roomy.submit(RequestRecord(str(i), first.prompt_ids, first.sampling, seed=first.seed))
    want = {int(r.request_id): r for r in roomy.stream()}
    terms = tolerance.model_terms(self.model.config)
    for i, (first, got) in enumerate(pairs):
      w, n = want[i], len(got.token_ids)
      where = f"request {first.request_id} (prompt {first.prompt_ids}, {first.sampling})"
      assert got.prompt_ids == first.prompt_ids, where
      assert len(got.logprobs) == len(got.versions) == n, where
      assert got.versions == sorted(got.versions), where
      assert all(0 <= v <= self.version for v in got.versions), where
      aborted = got is self.aborted.get(first.request_id)
      routes, expected = got.prompt_routing + got.routing, w.prompt_routing + w.routing[:n]
      expected = expected[: len(routes)]  # an aborted prompt may be partly prefilled
      same_tokens = (got.token_ids == w.token_ids[:n]) if aborted else (
        got.token_ids == w.token_ids and got.finish_reason == w.finish_reason
      )  # fmt: skip
      same = same_tokens and np.array_equal(np.sort(routes, -1), np.sort(expected, -1))
      tie = None if same else first_router_tie(self.model, self.params, first, w)
      if tie is not None:  # both are right from the tie on: compared up to it
        where += f", router near-tie at input {tie}"
        n = max(0, tie - len(first.prompt_ids) + 1)  # the tokens sampled before the tie
        routes, expected = routes[:tie], expected[:tie]
        assert got.token_ids[:n] == w.token_ids[:n], where
      else:
        assert same_tokens, where
      tolerance.assert_close(got.logprobs[:n], w.logprobs[:n], n=terms)
      if w.routing:  # MoE: the routes of every input the learner will feed (so far)
        np.testing.assert_array_equal(np.sort(routes, -1), np.sort(expected, -1), err_msg=where)
    for e in self.engines:
      e.drain()
      assert e.allocator.num_free == e.allocator.num_pages
      if e.ring_allocator is not None:
        assert e.ring_allocator.num_free == e.ring_allocator.num_pages


# Router-logit gaps within float32 rounding of two runs of the same weights in batches of other
# shapes (which sum in other orders: the grouped dispatch groups a call's rows by expert).
ROUTER_TIE = 1e-5


def first_router_tie(model, params, first: RequestRecord, want: RequestRecord) -> int | None:
  """The first input position of the roomy engine's sequence (`first`'s prompt, then `want`'s
  tokens) where an MoE layer's k-th and (k+1)-th best router logits are within `ROUTER_TIE`:
  from there on two right runs may route, and then sample, apart. None for a dense model, or
  where no input is that close."""
  if not model.config.is_moe:
    return None
  logits = []

  def route(logits_btx, *args, **kwargs):
    logits.append(np.asarray(logits_btx, np.float32)[0])
    return moe_route(logits_btx, *args, **kwargs)

  ids = jnp.asarray([first.prompt_ids + want.token_ids], jnp.int32)
  reference = Model(dataclasses.replace(model.config, moe_dispatch="dense"))
  with mock.patch.object(moe, "route", route), jax.disable_jit():
    reference.apply(params, ids)
  k = model.config.experts_per_token
  best = -np.sort(-np.stack(logits), axis=-1)  # [layers, positions, experts], descending
  near = (best[..., k - 1] - best[..., k] < ROUTER_TIE).any(0)
  return int(np.argmax(near)) if near.any() else None


def run_schedule(kind, mesh, operations):
  seed = int(os.environ.get("JAXRL_SCHEDULE_SEED") or np.random.default_rng().integers(1 << 31))
  model = MODELS[kind]
  if kind in MESHES:
    shape = MESHES[kind]
    mesh = make_mesh(jax.devices()[: math.prod(shape.values())], shape)
  schedule = Schedule(model, mesh, model.init(seed % 1000), np.random.default_rng(seed))
  try:
    schedule.run(operations)
    schedule.check(mesh)
  except BaseException as e:
    e.add_note(f"JAXRL_SCHEDULE_SEED={seed} replays this run (engine {schedule.cfg}).")
    raise
  return schedule


def test_a_random_schedule_gives_every_request_its_tokens(mesh):
  run_schedule("dense", mesh, operations=100)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "window", "moe-expert", "moe-grouped"])
@pytest.mark.parametrize("run", range(4))
def test_random_schedules_of_each_model_kind(mesh, kind, run):
  run_schedule(kind, mesh, operations=100)
