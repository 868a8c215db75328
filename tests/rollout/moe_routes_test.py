"""The paged engine's MoE routing trace: per input the learner feeds, the experts each layer
chose, through chunked prefills, snapshots, shared prompt pages and both expert dispatches."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import tolerance
from helpers.paged_engines import EOS, MODEL, PAD, engine

from jaxrl.model import Model, get_preset
from jaxrl.rollout import SamplingParams, StaticEngine
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.requests import RequestRecord
from jaxrl.sharding import ROLLOUT_RULES, make_mesh

TERMS = tolerance.model_terms(MODEL.config)


# Chunks of 5 tokens run in calls 8 columns wide: the routes of the padding columns are not a
# prompt token's (they were recorded as the next chunk's until 2026-11-29).
@pytest.mark.parametrize("prefill_chunk", [8, 5])
def test_moe_routing_trace_matches_a_full_forward_and_survives_snapshot(mesh, prefill_chunk):
  """The trace holds, per input position the learner feeds, the experts each layer chose."""
  moe = Model(get_preset("tiny-moe"))
  moe_params = moe.init(3)
  cfg = moe.config
  rng = np.random.default_rng(5)
  ps = [list(rng.integers(3, 60, n)) for n in (1, 9, 23, 30)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=12)
  e = PagedEngine(
    moe,
    mesh,
    ROLLOUT_RULES,
    eos_id=EOS,
    pad_id=PAD,
    config=PagedConfig(
      page_size=8, num_pages=8, max_running=4, prefill_chunk=prefill_chunk, decode_steps=2
    ),
  )
  e.update_weights(moe_params, 0)
  for i, p in enumerate(ps):
    e.submit(p, sp, request_id=str(i))
  for _ in range(4):
    e.step()
  moved = RequestRecord.from_dict(json.loads(json.dumps(e.snapshot("2").to_dict())))
  e.submit(moved)
  done = {r.request_id: r for r in e.stream()}
  assert e.num_preemptions > 0  # 8 pages of 8 slots cannot hold all four: re-prefill happens

  forward = jax.jit(lambda p, t: moe.apply(p, t, return_routing=True)[2])
  for i, prompt in enumerate(ps):
    r = done[str(i)]
    inputs = prompt + r.token_ids[:-1]
    expected = np.asarray(forward(moe_params, np.asarray([inputs], np.int32)))[0]
    got = np.asarray(r.prompt_routing + r.routing, np.int32).reshape(expected.shape)
    assert expected.shape == (len(inputs), cfg.num_layers, cfg.experts_per_token)
    assert len(r.prompt_routing) == len(prompt) - 1 and len(r.routing) == len(r.token_ids)
    # The order of the top-k within a token does not matter to the layer.
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(expected, -1))

  one_token_prompt = e.generate([ps[0]], sp, seed=0)[0]
  trace_shape = (cfg.num_layers, cfg.experts_per_token)
  assert one_token_prompt.routing.shape == (len(one_token_prompt.token_ids), *trace_shape)
  assert one_token_prompt.prompt_routing.shape == (0, *trace_shape)


def test_a_request_sharing_a_leaders_prompt_keeps_the_routes_it_came_with(mesh):
  """A multi-turn turn's request comes with the routes its trajectory's earlier turns traced
  (`multi_turn.turn_request`); sharing a leader's pages with the same ids, it keeps those and
  takes the leader's for the rest of its prompt only."""
  moe = Model(get_preset("tiny-moe"))
  params = moe.init(3)
  cfg = moe.config
  e = PagedEngine(moe, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD,
                  config=PagedConfig(page_size=8, num_pages=16, max_running=4))  # fmt: skip
  e.update_weights(params, 0)
  prompt = [int(t) for t in np.random.default_rng(1).integers(3, 60, 12)]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
  given = {  # five positions' routes from "earlier turns": not what these weights choose
    rid: [[[expert, expert + 1]] * cfg.num_layers for _ in range(5)]
    for rid, expert in (("a", 0), ("b", 4))
  }
  for rid, routes in given.items():
    e.submit(RequestRecord(rid, prompt, sampling, prompt_routing=[list(r) for r in routes]))
  done = {r.request_id: r for r in e.stream()}
  assert e.num_shared_prefill_tokens > 0
  forward = np.asarray(moe.apply(params, np.asarray([prompt[:-1]]), return_routing=True)[2])[0]
  for rid, routes in given.items():
    r = done[rid]
    assert r.prompt_routing[:5] == routes
    np.testing.assert_array_equal(np.sort(r.prompt_routing[5:], -1), np.sort(forward[5:], -1))


@pytest.mark.parametrize("axes", [{}, {"data": 4}], ids=["one-device", "data4"])
def test_the_grouped_dispatch_generates_as_the_reference_dispatch(axes):
  """`model.moe_dispatch="grouped"` (gmm on sorted assignments; on a data mesh each device its
  rows): the paged and static engines' greedy tokens, log-probs and routes equal the reference
  dispatch's."""
  dense = Model(get_preset("tiny-moe"))
  grouped = Model(dataclasses.replace(dense.config, moe_dispatch="grouped"))
  params = dense.init(7)
  devices = jax.devices()[: 4 if axes else 1]
  mesh = make_mesh(devices, axes)
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(3, 60, n)) for n in (1, 9, 23, 30)]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
  config = PagedConfig(page_size=8, num_pages=32, max_running=4, prefill_chunk=8, decode_steps=2)
  runs = {}
  for name, model in (("dense", dense), ("grouped", grouped)):
    for generator in (
      PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=config),
      StaticEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD),
    ):
      generator.update_weights(params, 0)
      runs[name, type(generator).__name__] = generator.generate(prompts, sampling, seed=0)
  assert runs["grouped", "PagedEngine"][0].routing is not None
  for kind in ("PagedEngine", "StaticEngine"):
    for want, got in zip(runs["dense", kind], runs["grouped", kind], strict=True):
      np.testing.assert_array_equal(got.token_ids, want.token_ids)
      np.testing.assert_array_equal(got.routing, want.routing)
      np.testing.assert_array_equal(got.prompt_routing, want.prompt_routing)
      tolerance.assert_close(got.logprobs, want.logprobs, n=TERMS)


def test_dense_models_have_no_routing_trace(mesh, params):
  out = engine(mesh, params).generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), seed=0)[0]
  assert out.routing is None and out.prompt_routing is None
