"""`spmd_engine`: a follower's engine repeats rank 0's calls, whatever order they arrive in."""

import time

import jax
import numpy as np
import pytest

from jaxrl.model import Model, get_preset
from jaxrl.rl.spmd_engine import Follower, MirroredEngine
from jaxrl.rollout import SamplingParams
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.requests import RequestRecord
from jaxrl.sharding import ROLLOUT_RULES, make_mesh

MODEL = Model(get_preset("tiny"))


def _engine(devices) -> PagedEngine:
  config = PagedConfig(page_size=16, num_pages=64, max_running=4, decode_steps=2)
  mesh = make_mesh(devices, {"data": len(devices)})
  return PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)


def test_a_follower_repeats_rank_0s_calls_in_order_and_ends_in_the_same_state():
  """Rank 0's calls (weights, submits, windows, an abort and a resubmission, new weights) go to
  a follower engine on other devices as messages, delivered in reverse order: the follower
  applies them in sequence and its requests end with rank 0's tokens and log-probs. Host-only
  calls travel with the next device call; a rejected request is not sent."""
  seed = int(np.random.default_rng().integers(1 << 16))
  rng = np.random.default_rng(seed)
  weights = {0: MODEL.init(seed), 1: MODEL.init(seed + 1)}
  messages = []
  rank0 = MirroredEngine(_engine(jax.devices()[:2]), messages.append, lambda v: ("v", v))
  rank0.update_weights(weights[0], 0)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True)
  for i in range(6):
    prompt = list(map(int, rng.integers(3, 60, rng.integers(2, 20))))
    rank0.submit(RequestRecord(f"r{i}", prompt, sampling, seed=i))
  with pytest.raises(ValueError, match="empty prompt"):
    rank0.submit(RequestRecord("bad", [], sampling))
  assert len(messages) == 1  # the submits wait for the next device call
  finished = rank0.step() + rank0.step()
  (partial,) = rank0.abort(["r1"])  # running (4 may run at once), 4 tokens in
  assert partial.token_ids and not partial.finish_reason
  rank0.submit(partial)
  while rank0.has_work:
    finished += rank0.step()
    if len(finished) >= 3 and rank0.version == 0:
      finished += rank0.drain()
      rank0.update_weights(weights[1], 1)

  follower = Follower(lambda token: (token[1], weights[token[1]]), "f")
  for seq in reversed(range(len(messages))):  # all out of order but the first
    follower.apply(seq, messages[seq])
  follower.start(_engine(jax.devices()[2:4]))
  deadline = time.monotonic() + 120
  while follower.applied < len(messages):
    assert follower.alive and time.monotonic() < deadline, follower.error
    time.sleep(0.05)
  assert not follower.engine.has_work and follower.engine.version == 1
  # The follower's engine grew its own copies of the records it was sent.
  sent = {
    args[0].request_id: args[0]
    for commands in messages
    for name, *args in commands
    if name == "submit"
  }
  assert "bad" not in sent and {r.request_id for r in finished} == {f"r{i}" for i in range(6)}
  for r in finished:
    assert sent[r.request_id].token_ids == r.token_ids
    np.testing.assert_allclose(sent[r.request_id].logprobs, r.logprobs, atol=1e-6, rtol=0)
    assert sent[r.request_id].versions == r.versions
  assert any(1 in r.versions for r in finished)
