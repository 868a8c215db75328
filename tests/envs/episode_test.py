"""Episodes: limits end them with a reason, failures never raise and never lose the trajectory."""

import asyncio
import random
import re

import pytest

from jaxrl.envs import EndEpisode, EnvError, Environment, Episode, EpisodeLimits, Step, run_episode


class Counter(Environment):
  """Rewards each turn with a fresh random number; ends when the model says "done"."""

  def __init__(self, rng, *, fail_at=None, failure=None, tool_calls=0):
    self.rng, self.fail_at, self.failure, self.tool_calls = rng, fail_at, failure, tool_calls
    self.turn = 0
    self.closed = 0
    self.given = []

  def reset(self, record):
    return [{"role": "user", "content": f"count for {record['id']}"}]

  def step(self, action):
    self.turn += 1
    if self.turn == self.fail_at:
      self.failure()
    reward = self.rng.uniform(0.1, 1.0)
    self.given.append(reward)
    info = {"tool_calls": self.tool_calls}
    return Step([{"role": "user", "content": f"turn {self.turn}"}], reward, action == "done", info)

  def close(self):
    self.closed += 1


def play(env, actions, limits, record=None):
  actions = iter(actions)
  return asyncio.run(
    run_episode(env, record or {"id": "r1"}, lambda messages: next(actions), limits, name="counter")
  )


def test_the_environment_ends_the_episode_and_rewards_sum():
  env = Counter(random.Random(0))
  episode = play(env, ["a", "b", "done"], EpisodeLimits(max_turns=5))
  s = episode.summary()
  assert (s.record_id, s.end_reason, s.turns, s.truncated, s.error) == (
    "r1",
    "done",
    3,
    False,
    None,
  )
  assert s.rewards == tuple(env.given) and s.reward == pytest.approx(sum(env.given))
  assert env.closed == 1
  assert [m["role"] for m in episode.messages] == ["user"] + ["assistant", "user"] * 3
  with pytest.raises(RuntimeError, match="has ended"):
    asyncio.run(episode.step("more"))


def test_max_turns_truncates_and_keeps_the_rewards():
  env = Counter(random.Random(1))
  episode = play(env, ["a"] * 10, EpisodeLimits(max_turns=3, failure_reward=-1.0))
  s = episode.summary()
  assert (s.end_reason, s.turns, s.truncated) == ("max_turns", 3, True)
  assert s.rewards == tuple(env.given)  # a limit is not a failure: the rewards stand


def test_max_tool_calls_ends_the_step_that_goes_past_it():
  env = Counter(random.Random(2), tool_calls=2)
  s = play(env, ["a"] * 10, EpisodeLimits(max_turns=10, max_tool_calls=5)).summary()
  assert (s.end_reason, s.turns, s.tool_calls, s.truncated) == ("max_tool_calls", 3, 6, True)


def _raise():
  raise KeyError("the state was lost")


def _end_episode():
  raise EndEpisode("tool_timeout", "slow")


@pytest.mark.parametrize(
  "failure, reason, error",
  [
    (_raise, "env_error", "counter.step\\(\\) raised KeyError: 'the state was lost'"),
    (_end_episode, "tool_timeout", "slow"),
  ],
)
def test_a_failing_step_ends_the_episode_with_its_reason_and_keeps_the_trajectory(
  failure, reason, error
):
  env = Counter(random.Random(3), fail_at=3, failure=failure)
  limits = EpisodeLimits(max_turns=10, failure_reward=-0.5)
  episode = play(env, ["a", "b", "c", "d"], limits)
  s = episode.summary()
  assert s.end_reason == reason and s.turns == 3 and not s.truncated
  assert s.rewards == (*env.given, -0.5)
  assert s.error and re.search(error, s.error)
  assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == ["a", "b", "c"]
  assert env.closed == 1


def test_a_step_of_the_wrong_type_ends_the_episode_naming_the_field():
  class Wrong(Environment):
    def reset(self, record):
      return [{"role": "user", "content": "go"}]

    def step(self, action):
      return Step([{"role": "user", "content": ["not", "text"]}], 1.0, False)

  s = play(Wrong(), ["a"], EpisodeLimits(failure_reward=0.0)).summary()
  assert s.end_reason == "env_error"
  assert "environment counter: step() returned Step.messages[0]['content']" in s.error


def test_a_hung_async_step_ends_with_step_timeout():
  class Hangs(Environment):
    async def reset(self, record):
      return [{"role": "user", "content": "go"}]

    async def step(self, action):
      await asyncio.sleep(30)

  s = play(Hangs(), ["a"], EpisodeLimits(step_timeout_s=0.05, failure_reward=-1.0)).summary()
  assert (s.end_reason, s.rewards) == ("step_timeout", (-1.0,))
  assert "took longer than its timeout of 0.05 s" in s.error


def test_one_crashing_episode_does_not_affect_the_others():
  rng = random.Random(4)
  crash_at = {i: rng.choice([None, 1, 2]) for i in range(12)}

  async def main():
    envs = [Counter(random.Random(i), fail_at=crash_at[i], failure=_raise) for i in range(12)]

    async def one(i):
      actions = iter(["a", "b", "done"])
      return await run_episode(envs[i], {"id": str(i)}, lambda m: next(actions), EpisodeLimits())

    return envs, await asyncio.gather(*(one(i) for i in range(12)))

  envs, episodes = asyncio.run(main())
  for i, (env, episode) in enumerate(zip(envs, episodes, strict=True)):
    s = episode.summary()
    if crash_at[i] is None:
      assert (s.end_reason, s.turns, s.rewards) == ("done", 3, tuple(env.given))
    else:
      assert (s.end_reason, s.turns) == ("env_error", crash_at[i])
    assert s.record_id == str(i)


def test_reset_errors_name_the_environment_and_the_record():
  class BadReset(Environment):
    def __init__(self, value):
      self.value = value
      self.closed = False

    def reset(self, record):
      if isinstance(self.value, Exception):
        raise self.value
      return self.value

    def step(self, action):
      return Step()

    def close(self):
      self.closed = True

  for value, match in [
    ([], r"environment bad \(record 'q7'\): reset\(\) returned is empty"),
    ("hello", r"reset\(\) returned = 'hello' \(str\)"),
    (ValueError("no such file"), r"reset\(\) raised ValueError: no such file"),
  ]:
    env = BadReset(value)
    with pytest.raises(EnvError, match=match):
      asyncio.run(Episode(env, EpisodeLimits(), name="bad").reset({"id": "q7"}))
    assert env.closed


def test_step_before_reset_and_limits_are_checked():
  with pytest.raises(RuntimeError, match="call reset"):
    asyncio.run(Episode(Counter(random.Random(0)), EpisodeLimits()).step("a"))
  for kwargs in ({"max_turns": 0}, {"max_tool_calls": 1.5}, {"step_timeout_s": 0}):
    with pytest.raises(ValueError, match="EpisodeLimits"):
      EpisodeLimits(**kwargs)


def test_the_engine_can_end_an_episode_for_max_tokens():
  env = Counter(random.Random(5))

  async def main():
    episode = Episode(env, EpisodeLimits())
    await episode.reset({"id": "t"})
    await episode.step("a")
    episode.end("max_tokens")
    return episode

  s = asyncio.run(main()).summary()
  assert (s.end_reason, s.turns, s.truncated) == ("max_tokens", 1, True)
  assert env.closed == 1
