"""The synthetic guessing game: deterministic splits, the optimal policy scores full reward and
a random one scores less."""

import asyncio
import random
import re

import numpy as np
import pytest

from jaxrl.envs import EnvError, EpisodeLimits, GuessNumberEnv, run_episode
from jaxrl.envs.guess_number import optimal_guesses, problems, records


def binary_search(messages):
  """The optimal policy: bisect the range the feedback leaves."""
  low, high = map(int, re.findall(r"\d+", messages[0]["content"]))
  guesses = [m["content"] for m in messages if m["role"] == "assistant"]
  replies = [m["content"] for m in messages[2::2]]
  for guess, reply in zip(guesses, replies, strict=True):
    if reply == "higher":
      low = int(guess) + 1
    elif reply == "lower":
      high = int(guess) - 1
  return str((low + high) // 2)


def random_policy(seed):
  rng = random.Random(seed)

  def policy(messages):
    low, high = map(int, re.findall(r"\d+", messages[0]["content"]))
    return f"my guess is {rng.randint(low, high)}"

  return policy


def mean_reward(test_records, policy, **env_kwargs):
  async def main():
    episodes = [
      run_episode(GuessNumberEnv(**env_kwargs), r, policy, EpisodeLimits(max_turns=10))
      for r in test_records
    ]
    return [e.summary() for e in await asyncio.gather(*episodes)]

  summaries = asyncio.run(main())
  return float(np.mean([s.reward for s in summaries])), summaries


def test_the_optimal_policy_scores_full_reward_and_a_random_one_less():
  test = records("test", 100)
  best, summaries = mean_reward(test, binary_search)
  assert best == 1.0
  assert {s.end_reason for s in summaries} == {"solved"}
  assert max(s.turns for s in summaries) == 4  # widths 7 and 15: at most 3 and 4 guesses
  rand, summaries = mean_reward(test, random_policy(0))
  assert rand < 0.6
  assert {s.end_reason for s in summaries} == {"solved", "out_of_guesses"}


def test_rewards_for_early_late_and_failed_games():
  env = GuessNumberEnv(max_guesses=5, late_reward=0.25)
  record = {"id": "x", "low": 1, "high": 7, "target": 5}
  assert env.reset(record) == [{"role": "user", "content": "guess a number from 1 to 7:"}]
  steps = [env.step(a) for a in ["4", "I think 6", "oops", "99", "5"]]
  assert [m["content"] for s in steps[:4] for m in s.messages] == [
    "higher",
    "lower",
    "answer with a number from 1 to 7",
    "answer with a number from 1 to 7",
  ]
  assert (steps[-1].reward, steps[-1].done, steps[-1].info["end_reason"]) == (0.25, True, "solved")
  env.reset(record)
  steps = [env.step(a) for a in ["1", "2", "3", "4", "6"]]
  assert [(s.reward, s.done) for s in steps] == [(0.0, False)] * 4 + [(0.0, True)]
  assert steps[-1].info["end_reason"] == "out_of_guesses"
  env.reset(record)
  assert env.step("4").reward == 0 and env.step("6").reward == 0 and env.step("5").reward == 1.0


def test_optimal_guesses_is_binary_searchs_worst_case():
  for width in range(1, 40):
    worst = 0
    for target in range(width):
      lo, hi, n = 0, width - 1, 0
      while True:
        n += 1
        mid = (lo + hi) // 2
        if mid == target:
          break
        lo, hi = (mid + 1, hi) if mid < target else (lo, mid - 1)
      worst = max(worst, n)
    assert optimal_guesses(10, 10 + width - 1) == worst


def test_splits_are_deterministic_disjoint_and_the_test_split_ignores_the_seed():
  train_a, train_b = records("train", 300, seed=1), records("train", 300, seed=1)
  assert train_a == train_b
  assert records("train", 300, seed=2) != train_a
  test = records("test", 80)
  assert records("test", 80, seed=9) == test
  assert records("test", 30) == test[:30]
  assert not {r["id"] for r in train_a} & {r["id"] for r in test}
  all_problems = len(problems(50, (7, 15)))
  assert 0.05 < len({r["id"] for r in records("test", 80)}) / all_problems < 0.15
  for r in test:
    assert r["low"] <= r["target"] <= r["high"] and r["answer"] == str(r["target"])
    assert r["messages"] == [{"role": "user", "content": r["prompt"]}]


def test_bad_records_and_options_are_clear_errors():
  assert len(records("test", 10_000)) == 111  # all there are (eval asks for more: warned)
  with pytest.raises(ValueError, match="split .valid.: use one of"):
    records("valid", 1)
  env = GuessNumberEnv(max_guesses=3)
  with pytest.raises(EnvError, match="needs integer 'low', 'high' and 'target'"):
    env.reset({"id": "q", "low": 1, "high": 7})
  with pytest.raises(EnvError, match="the range 0..14 needs 4 guesses, more than max_guesses=3"):
    env.reset({"id": "q", "low": 0, "high": 14, "target": 3})
  with pytest.raises(EnvError, match="target not in"):
    env.reset({"id": "q", "low": 0, "high": 4, "target": 9})
  with pytest.raises(ValueError, match="late_reward"):
    GuessNumberEnv(late_reward=2.0)


def test_say_range_names_the_range_left_and_the_scripted_policy_draws_from_it():
  record = {"id": "q", "low": 10, "high": 24, "target": 19}
  env = GuessNumberEnv(say_range=True)
  env.reset(record)
  assert env.step("13").messages == [{"role": "user", "content": "higher: 14 to 24"}]
  assert env.step("my guess is 22").messages[0]["content"] == "lower: 14 to 21"
  assert env.step("99").messages[0]["content"] == "answer with a number from 14 to 21"
  rng = np.random.default_rng(0)
  draws = {int(env.scripted_action(rng)) for _ in range(400)}
  assert draws == set(range(14, 22))  # uniform over what is left, nothing outside it

  def scripted(seed):
    rng = np.random.default_rng(seed)
    envs = {}

    def policy(messages):
      return envs["env"].scripted_action(rng)

    return envs, policy

  async def play(r, i):
    envs, policy = scripted(i)
    envs["env"] = GuessNumberEnv(say_range=True)
    from jaxrl.envs import Episode

    episode = Episode(envs["env"], EpisodeLimits(max_turns=10))
    await episode.reset(r)
    while not episode.done:
      await episode.step(policy(episode.messages))
    return episode.summary()

  async def main(test):
    return await asyncio.gather(*(play(r, i) for i, r in enumerate(test)))

  summaries = asyncio.run(main(records("test", 100)))
  mean = np.mean([s.reward for s in summaries])
  # Below bisection's 1.0, above a policy that ignores the feedback.
  assert 0.45 < mean < 0.9, mean
  assert all(s.end_reason in ("solved", "out_of_guesses") for s in summaries)


def test_the_single_turn_task_scores_a_one_shot_guess():
  from jaxrl.data.tasks import TaskConfig, make_task

  task = make_task(TaskConfig(name="guess_number", guess_max_low=5, guess_widths=(4,)))
  record = task.records("train", 3, seed=0)[0]
  assert task.reward(record, f"it is {record['target']}") == 1.0
  assert task.reward(record, f"{record['target'] + 1}") == 0.0
  assert task.reward(record, "no idea") == 0.0
