"""Multi-turn rollouts on the paged engine: token in, token out, across turns and a weight update;
failing environments end their own episode only."""

import collections
import os
import threading

import jax
import numpy as np
import pytest
from helpers.scripted_multi_turn import ScriptedEngine, UnrenderableGuessEnv

from jaxrl.data.guess_number import make_record
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs import EpisodeLimits, GuessNumberEnv, continuation_ids, prompt_ids
from jaxrl.envs import guess_number as game
from jaxrl.model import Model, get_preset
from jaxrl.rl.multi_turn import MultiTurnRollout, trajectory_batch
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = CharTokenizer()
# Rows past the char vocabulary are masked out of sampling, so every sampled id decodes.
MODEL = Model(get_preset("tiny", vocab_limit=TOKENIZER.vocab_size, max_seq_len=256))


@pytest.fixture(scope="module")
def engine():
  mesh = make_mesh(jax.devices()[:2], {"data": 2})
  config = PagedConfig(page_size=8, num_pages=160, max_running=8, decode_steps=4)
  e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=TOKENIZER.eos_id, pad_id=0, config=config)
  e.update_weights(MODEL.init(0), 0)
  return e


def records(n, seed=0):
  return game.records("train", n, seed, max_low=20, widths=(7,))  # 3 guesses suffice


def test_the_learner_gets_exactly_the_ids_the_engine_sampled_across_turns_and_versions(engine):
  rollout = MultiTurnRollout(
    engine,
    TOKENIZER,
    lambda: GuessNumberEnv(max_guesses=4),
    EpisodeLimits(max_turns=4, step_timeout_s=30),
    max_tokens=240,
  )
  turns = {}  # request id (one per trajectory) -> the engine's finished records, in turn order
  step = engine.step

  def recording_step():
    finished = step()
    for r in finished:
      turns.setdefault(r.request_id, []).append(r)
    return finished

  engine.step = recording_step
  new_weights = MODEL.init(1)

  def update_after_first_turn(index, trajectory):
    if engine.version == 0:
      engine.update_weights(new_weights, 1)  # mid-episode for the others

  rollout.on_turn.append(update_after_first_turn)
  recs = records(6)
  try:
    result = rollout.run(recs, SamplingParams(temperature=1.0, max_new_tokens=6), seed=3)
  finally:
    del engine.step
    engine.update_weights(MODEL.init(0), 0)
  assert not result.skipped and len(result.trajectories) == 6
  versions_seen = set()
  for i, (t, record) in enumerate(zip(result.trajectories, recs, strict=True)):
    env = GuessNumberEnv(max_guesses=4)
    expected = prompt_ids(TOKENIZER, env.reset(record))
    assert t.token_ids[: t.prompt_len] == expected and t.prompt_len == len(expected)
    for k in range(t.turns):
      turn = turns[f"traj.{i}"][k]
      # The engine was given the trajectory so far as it is (never re-tokenised) ...
      assert turn.prompt_ids == expected
      expected = expected + turn.token_ids
      start = len(turn.prompt_ids)
      span = slice(start, start + len(turn.token_ids))
      # ... and the trajectory holds its ids as sampled, with their log-probs and versions.
      assert t.token_ids[span] == turn.token_ids and set(t.sampled[span]) == {1}
      assert t.logprobs[span] == turn.logprobs and t.versions[span] == turn.versions
      versions_seen.update(turn.versions)
      ended_on_stop = turn.token_ids[-1] == TOKENIZER.eos_id
      text = TOKENIZER.decode(turn.token_ids[:-1] if ended_on_stop else turn.token_ids)
      answer = env.step(text)
      if not answer.done:
        stop = turn.token_ids[-1] if ended_on_stop else None
        expected = expected + continuation_ids(TOKENIZER, answer.messages, stop_id=stop)
    assert t.token_ids == expected  # nothing else in between
    assert len(turns[f"traj.{i}"]) == t.turns
    assert sum(t.sampled) == sum(len(turn.token_ids) for turn in turns[f"traj.{i}"])
    assert t.summary.turns == t.turns and t.summary.end_reason in ("solved", "out_of_guesses")
  assert versions_seen == {0, 1}  # trajectories spanned the weight update
  assert max(t.turns for t in result.trajectories) > 1

  batch = trajectory_batch(result.trajectories, np.arange(6.0), pad_id=0)
  for i, t in enumerate(result.trajectories):
    n = len(t.token_ids)
    np.testing.assert_array_equal(batch.tokens_bt[i, :n], t.token_ids)
    # Target j is id j + 1: the loss mask is 1 exactly on sampled ids.
    np.testing.assert_array_equal(batch.mask_bt[i, : n - 1], t.sampled[1:])
    assert batch.mask_bt[i, n - 1 :].sum() == 0
    np.testing.assert_array_equal(batch.old_logp_bt[i, : n - 1], np.float32(t.logprobs[1:]))


def test_kept_turn_pages_give_the_same_trajectories_and_prefill_less():
  mesh = make_mesh(jax.devices()[:2], {"data": 2})
  params = MODEL.init(5)
  out = {}
  for keep in (True, False):
    config = PagedConfig(
      page_size=8, num_pages=160, max_running=8, decode_steps=4, keep_turn_kv=keep
    )
    e = PagedEngine(MODEL, mesh, ROLLOUT_RULES, eos_id=TOKENIZER.eos_id, pad_id=0, config=config)
    e.update_weights(params, 0)
    rollout = MultiTurnRollout(
      e,
      TOKENIZER,
      lambda: GuessNumberEnv(max_guesses=4),
      EpisodeLimits(max_turns=4, step_timeout_s=30),
      max_tokens=240,
    )
    result = rollout.run(
      records(6, seed=1), SamplingParams(temperature=1.0, max_new_tokens=6), seed=4
    )
    assert e.num_preemptions == 0 and len(e.park) == 0  # ended episodes dropped theirs
    assert e.allocator.num_free == e.allocator.num_pages
    out[keep] = result.trajectories, e.num_prefill_tokens, e.num_kept_prefill_tokens
  (on, prefilled_on, kept_on), (off, prefilled_off, kept_off) = out[True], out[False]
  assert max(t.turns for t in on) > 1
  for a, b in zip(on, off, strict=True):
    assert a.token_ids == b.token_ids and a.sampled == b.sampled and a.turns == b.turns
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
  # Every token a kept page held is one the prefill calls did not compute.
  assert kept_off == 0 and kept_on > 0 and prefilled_on == prefilled_off - kept_on


@pytest.mark.parametrize("keep", [True, False], ids=["kept-pages", "prefilled-again"])
def test_an_moe_trajectory_carries_the_routes_that_sampled_each_id(keep):
  """Routing replay across turns: each id's routes are those of the weights and context that
  fed it first (its prefill, or the decode step after it), whichever turn that was. New
  weights after the first turns drop the parked pages, so the next turns prefill again with
  other weights; the ids the earlier turns fed keep their routes all the same."""
  moe = Model(get_preset("tiny-moe", vocab_limit=TOKENIZER.vocab_size, max_seq_len=256))
  weights = [moe.init(3), moe.init(4)]
  mesh = make_mesh(jax.devices()[:2], {"data": 2})
  config = PagedConfig(page_size=8, num_pages=160, max_running=8, decode_steps=4,
                       keep_turn_kv=keep)  # fmt: skip
  e = PagedEngine(moe, mesh, ROLLOUT_RULES, eos_id=TOKENIZER.eos_id, pad_id=0, config=config)
  e.update_weights(weights[0], 0)
  rollout = MultiTurnRollout(
    e, TOKENIZER, lambda: GuessNumberEnv(max_guesses=4),
    EpisodeLimits(max_turns=4, step_timeout_s=30), max_tokens=240,
  )  # fmt: skip
  turns = collections.defaultdict(list)  # trajectory index -> its turns' records
  fed_at = {}  # trajectory index -> per input position, the version that first fed it

  def on_turn(index, trajectory):
    record = turns[index][-1]
    fed = fed_at.setdefault(index, [])
    prompt_inputs = len(record.prompt_ids) - 1 - len(fed)  # the ids this turn prefilled
    fed += [record.versions[0]] * prompt_inputs + list(record.versions)
    if e.version == 0 and trajectory.turns == 2:
      e.update_weights(weights[1], 1)

  step = e.step
  e.step = lambda: [turns[int(r.request_id.split(".")[1])].append(r) or r for r in step()]
  rollout.on_turn.append(on_turn)
  result = rollout.run(
    records(6, seed=2), SamplingParams(temperature=1.0, max_new_tokens=6), seed=5
  )
  forward = jax.jit(lambda p, t: moe.apply(p, t, return_routing=True)[2])
  versions = set()
  for i, t in enumerate(result.trajectories):
    inputs = np.asarray([t.token_ids[:-1]], np.int32)
    by_version = [np.sort(np.asarray(forward(w, inputs))[0], -1) for w in weights]
    assert len(t.routes) == len(t.token_ids) - 1 == len(fed_at[i])
    want = np.stack([by_version[v][p] for p, v in enumerate(fed_at[i])])
    np.testing.assert_array_equal(np.sort(t.routes, -1), want, err_msg=f"trajectory {i}")
    versions.update(fed_at[i])
  assert versions == {0, 1} and max(t.turns for t in result.trajectories) > 2
  batch = trajectory_batch(result.trajectories, np.zeros(6), pad_id=0)
  for i, t in enumerate(result.trajectories):
    np.testing.assert_array_equal(batch.routes_btlk[i, : len(t.routes)], t.routes)
    assert (batch.routes_btlk[i, len(t.routes) :] == -1).all()


class _Faulty(GuessNumberEnv):
  """Hangs on target 3 (until `release` is set), raises on target 4, else plays the game."""

  release = threading.Event()
  hanging = threading.Event()  # set while a hung step is inside

  def step(self, action):
    if self._target == 3:
      self.hanging.set()
      self.release.wait(120)
      self.hanging.clear()
    if self._target == 4:
      raise RuntimeError("the tool crashed")
    return super().step(action)


def test_a_failing_environment_ends_its_own_episode_and_keeps_its_tokens(engine):
  rollout = MultiTurnRollout(
    engine,
    TOKENIZER,
    lambda: _Faulty(max_guesses=3),
    # Every reset and step has this limit: 0.5 s ended a healthy agent game in a full run on the
    # 2-core VM (tests/rl/agent_test.py); the hung step waits for `release`, far longer.
    EpisodeLimits(max_turns=3, step_timeout_s=3.0, failure_reward=-1.0),
    max_tokens=240,
  )
  recs = [make_record(0, 6, target) for target in (1, 3, 4, 5)]
  recs.append({"id": "broken", "low": 0, "high": 6})  # no target: reset fails
  try:
    result = rollout.run(recs, SamplingParams(temperature=1.0, max_new_tokens=5), seed=0)
    assert _Faulty.hanging.is_set()  # the run ended without waiting for the hung step
  finally:
    _Faulty.release.set()
  assert [r["id"] for r, _ in result.skipped] == ["broken"]
  assert "target" in result.skipped[0][1]
  by_target = {t.record["target"]: t for t in result.trajectories}
  assert by_target[3].summary.end_reason == "step_timeout"
  assert by_target[4].summary.end_reason == "env_error"
  assert "the tool crashed" in by_target[4].summary.error
  for target in (3, 4):
    t = by_target[target]
    assert t.turns == 1 and sum(t.sampled) > 0 and t.summary.reward == -1.0
  for target in (1, 5):  # untouched by the others' failures
    assert by_target[target].summary.end_reason in ("solved", "out_of_guesses")


def test_a_trajectory_out_of_tokens_ends_with_max_tokens(engine):
  rollout = MultiTurnRollout(
    engine,
    TOKENIZER,
    lambda: GuessNumberEnv(max_guesses=6),
    EpisodeLimits(max_turns=6),
    max_tokens=48,
  )
  sampling = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
  result = rollout.run(records(3, seed=1), sampling, seed=2)
  for t in result.trajectories:
    assert len(t.token_ids) <= 48
    if t.summary.end_reason == "max_tokens":
      assert t.summary.truncated
  assert any(t.summary.end_reason == "max_tokens" for t in result.trajectories)


def test_a_complete_turn_in_the_last_slot_is_scored():
  """A turn that ends on its stop id exactly at max_tokens is complete: the environment gets
  it (it used to end the episode "max_tokens" unscored)."""
  record = make_record(0, 6, 4)
  prompt = prompt_ids(TOKENIZER, GuessNumberEnv().reset(record))
  for room, reason in ((1, "max_tokens"), (2, "solved"), (3, "solved")):  # "4" + EOS is 2 ids
    rollout = MultiTurnRollout(
      ScriptedEngine(lambda rid, turn, ids: "4", TOKENIZER),
      TOKENIZER,
      lambda: GuessNumberEnv(max_guesses=4),
      EpisodeLimits(max_turns=4),
      max_tokens=len(prompt) + room,
    )
    (t,) = rollout.run([record], SamplingParams(max_new_tokens=8), seed=0).trajectories
    assert t.summary.end_reason == reason, room
    assert t.reward == (1.0 if reason == "solved" else 0.0) and t.turns == 1


def test_messages_the_tokenizer_cannot_render_end_that_episode_only():
  rollout = MultiTurnRollout(
    ScriptedEngine(lambda rid, turn, ids: "3", TOKENIZER),
    TOKENIZER,
    lambda: UnrenderableGuessEnv(max_guesses=4),
    EpisodeLimits(max_turns=4, failure_reward=-1.0),
    max_tokens=200,
  )
  recs = [make_record(0, 7, target) for target in (3, 5, 6)]
  result = rollout.run(recs, SamplingParams(max_new_tokens=8), seed=0)
  assert [r["target"] for r, _ in result.skipped] == [6]
  by_target = {t.record["target"]: t for t in result.trajectories}
  assert by_target[3].summary.end_reason == "solved"
  assert by_target[5].summary.end_reason == "env_error" and by_target[5].reward == -1.0


def test_the_training_driver_ends_an_episode_whose_messages_cannot_be_rendered(tmp_path):
  """The RL loop's driver (`EpisodeDriver`): the episode ends "env_error" with the failure
  reward; the controller's event loop goes on (it used to raise out of `on_event`)."""
  import queue

  from jaxrl.config import load_config
  from jaxrl.rl.episodes import EpisodeDriver
  from jaxrl.rl.groups import Group
  from jaxrl.rollout.requests import RequestRecord

  overrides = {"env.name": "helpers.scripted_multi_turn:UnrenderableGuessEnv", "env.kwargs": {}}
  overrides["env.limits.failure_reward"] = -1.0
  cfg = load_config(os.path.join(REPO, "configs", "grpo_agent.py"), "test", overrides)
  sampling = SamplingParams(max_new_tokens=4)
  driver = EpisodeDriver(
    cfg, TOKENIZER, sampling, queue.Queue(), max_tokens=160, template_kwargs={}
  )
  try:
    record = RequestRecord("g0.0", [], sampling, seed=1)
    group = Group(0, make_record(0, 7, 5), 0, [record], [False])
    driver.start(group)
    assert driver.on_event(driver.events.get(timeout=60), group).queued == [0]
    turn = group.records[0]
    turn.token_ids, turn.logprobs = [*TOKENIZER.encode("3"), TOKENIZER.eos_id], [-1.0, -1.0]
    turn.versions, turn.finish_reason = [0, 0], "stop"
    assert not driver.turn_ended(group, 0, turn)
    outcome = driver.on_event(driver.events.get(timeout=60), group)
    assert outcome.ended == [0]
    summary = group.episodes[0].trajectory.summary
    assert summary.end_reason == "env_error" and summary.reward == -1.0
    assert "cannot be rendered" in summary.error
  finally:
    driver.close()


def test_a_resumed_episode_ending_before_its_replay_keeps_the_replayed_rewards():
  """Resumed with three steps played, its turn fills max_tokens at once, while the slow replay
  of those steps still runs: the episode ends after the replay, with their rewards."""
  import queue

  from helpers.scripted_multi_turn import SlowShapedGuessEnv

  from jaxrl.config import load_config
  from jaxrl.rl.episodes import EpisodeDriver
  from jaxrl.rl.groups import EpisodeState, Group
  from jaxrl.rl.multi_turn import Trajectory, turn_request

  name = "helpers.scripted_multi_turn:SlowShapedGuessEnv"
  cfg = load_config(os.path.join(REPO, "configs", "grpo_agent.py"), "test", {"env.name": name})
  sampling, limit = SamplingParams(max_new_tokens=40), 80
  driver = EpisodeDriver(
    cfg, TOKENIZER, sampling, queue.Queue(), max_tokens=limit, template_kwargs={}
  )
  try:
    record, env = make_record(0, 14, 13), SlowShapedGuessEnv(max_guesses=6)
    trajectory = Trajectory.start(record, prompt_ids(TOKENIZER, env.reset(record)))
    for guess in ("1", "2", "3"):  # what the run before the resume played
      ids = [*TOKENIZER.encode(guess), TOKENIZER.eos_id]
      trajectory.append(ids, [-1.0] * len(ids), [0] * len(ids))
      trajectory.turns += 1
      trajectory.actions.append(guess)
      trajectory.last_stop = TOKENIZER.eos_id
      messages = env.step(guess).messages
      trajectory.append(continuation_ids(TOKENIZER, messages, stop_id=TOKENIZER.eos_id))
    turn = turn_request(trajectory, "g0.0", sampling, 7, limit)
    group = Group(0, record, 0, [turn], [False], episodes=[EpisodeState("turn", trajectory)])
    assert driver.restore(group) == [0]
    turn.token_ids = TOKENIZER.encode("9") * (limit - len(trajectory.token_ids))
    turn.logprobs, turn.versions = [-1.0] * len(turn.token_ids), [0] * len(turn.token_ids)
    turn.finish_reason = "length"
    assert not driver.turn_ended(group, 0, turn)  # ended once the replay is done
    assert driver.on_event(driver.events.get(timeout=60), group).ended == [0]
    summary = group.episodes[0].trajectory.summary
    assert summary.end_reason == "max_tokens" and summary.turns == 3
    assert summary.reward == pytest.approx(0.3)
  finally:
    driver.close()
