"""Multi-turn groups in the RL loop: each response of a group is an episode of `config.env`.

One response j of group g goes through these phases (`EpisodeState.phase`):
  "reset"  its environment is being reset (`Episode.reset`, on the `EnvRunner`);
  "turn"   a model turn is queued or decoding on a worker: request "g{g}.{j}", as a
           single-turn response would be, whose prompt is the trajectory so far;
  "env"    the turn ended; the environment is taking its step;
  "done"   the episode ended (the environment said so, a limit, or a failure).
A group's turns start once all of its resets succeeded; a group whose reset failed is dropped
whole (the controller releases another prompt in its place). When a turn ends, its ids are
appended as sampled (`multi_turn.end_turn`) and its text goes to the environment; the answer's
ids are appended unsampled (`multi_turn.append_answer`) and the next turn is queued. A response
waiting for its environment holds no decode slot: the workers decode the others meanwhile. Its
KV pages stay parked on the worker that ran its turn while memory allows (`turn_request` sets
`keep_kv`); a next turn that runs there prefills only the environment's answer, one that runs
elsewhere or finds them evicted is prefilled again, as after a preemption. When the episode
ends the controller has that worker drop them (`RolloutWorker.drop_kept`). Environment calls
finish on the runner's thread and come back to the controller as `EnvEvent`s through the
workers' event queue, so the controller's state changes on its own thread only.

Checkpoints keep each trajectory (ids, loss mask, log-probs, versions, the actions so far) and
its phase. A resumed run rebuilds each open episode's environment by replaying its actions
(reset, then each action's step, whose answers are already in the trajectory as ids) and goes
on: a turn that was decoding is queued again with its tokens so far, a step that was running is
taken again. This is exact for environments whose answers depend only on the record and the
actions (both shipped ones; a step timeout or a tool's wall-clock limit may differ on replay).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs import (
  EnvError,
  Episode,
  Step,
  check_tools_render,
  end_of_turn_id,
  prompt_ids,
  run_reset,
)
from jaxrl.envs.remote import EnvWorkers
from jaxrl.envs.runner import EnvRunner
from jaxrl.rl.backends import init_ray
from jaxrl.rl.groups import EpisodeState, Group
from jaxrl.rl.multi_turn import (
  MultiTurnRollout,
  Trajectory,
  append_answer,
  end_turn,
  trajectory_batch,
  turn_request,
)
from jaxrl.rollout.paged import PagedEngine
from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.train.batch import TrainBatch

log = logging.getLogger(__name__)
_RESET_CHECK_S = 60.0  # the start-up check's limit on one reset


@dataclasses.dataclass
class EnvEvent:
  """An environment call of response `index` of group `gid` ended; `future` holds its result
  (`reset`: the first messages; `step`: the `Step`) or what it raised."""

  gid: int
  index: int
  kind: str  # "reset" | "step"
  future: concurrent.futures.Future


@dataclasses.dataclass
class EventOutcome:
  """What an `EnvEvent` asks of the controller: responses whose next turn is queued, responses
  whose episode ended, or (`failed`) the group cannot run (a reset failed: why)."""

  queued: list[int] = dataclasses.field(default_factory=list)
  ended: list[int] = dataclasses.field(default_factory=list)
  failed: str | None = None


class EpisodeDriver:
  """The environment side of a multi-turn run's groups, for the controller.

  Args:
    cfg: the run's config (`config.env`, the chat template variables).
    tokenizer: renders messages to ids and turns to text.
    sampling: the sampling of every training turn (its `max_new_tokens` bounds one turn).
    events: where `EnvEvent`s go (the controller's worker event queue).
    max_tokens: ids a trajectory may hold.
    template_kwargs: chat template variables of every prompt.
  """

  def __init__(
    self,
    cfg: ExperimentConfig,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    events: queue.Queue,
    *,
    max_tokens: int,
    template_kwargs: dict[str, Any],
  ):
    self.cfg = cfg
    self.env_workers = start_env_workers(cfg)
    self.make_env = self.env_workers.make_env if self.env_workers else cfg.env.make_env()
    self.limits = cfg.env.limits
    self.tokenizer = tokenizer
    self.sampling = sampling
    self.events = events
    self.max_tokens = max_tokens
    self.template_kwargs = dict(template_kwargs)
    self.runner = EnvRunner(cfg.env.threads)

  def close(self) -> None:
    self.runner.close()
    if self.env_workers is not None:
      self.env_workers.close()

  # -- environment calls -------------------------------------------------------------------------

  def _episode(self) -> Episode:
    return Episode(self.make_env(), self.limits, executor=self.runner.executor)

  def _submit(self, gid: int, index: int, kind: str, coroutine) -> None:
    def post(future: concurrent.futures.Future) -> None:
      self.events.put(EnvEvent(gid, index, kind, future))

    self.runner.submit(coroutine, post)

  def start(self, group: Group) -> None:
    """Starts a new group's episodes: resets their environments."""
    group.episodes = [EpisodeState() for _ in group.records]
    self._reset(group)

  def _reset(self, group: Group) -> None:
    for j, state in enumerate(group.episodes):
      state.phase, state.trajectory, state.episode = "reset", None, self._episode()
      self._submit(group.gid, j, "reset", state.episode.reset(dict(group.prompt)))

  def turn_ended(self, group: Group, index: int, record: RequestRecord) -> bool:
    """Appends a finished turn and hands its text to the environment; True when the episode
    ended at once instead (no room left: "max_tokens")."""
    state = group.episodes[index]
    text = end_turn(state.trajectory, record, self.tokenizer, self.max_tokens)
    if text is None:
      if state.replayed is not None and not state.replayed.done():
        # A resumed episode whose environment is still being rebuilt: end it after the
        # replay, so that its summary holds the replayed steps' rewards.
        state.phase = "env"
        self._submit(group.gid, index, "step", self._end_after_replay(state, "max_tokens"))
        return False
      self._end(state, "max_tokens")
      return True
    state.phase = "env"
    self._submit(group.gid, index, "step", self._after_replay(state, state.episode.step(text)))
    return False

  @staticmethod
  async def _end_after_replay(state: EpisodeState, reason: str) -> Step:
    await asyncio.wrap_future(state.replayed)
    state.episode.end(reason)
    return Step([], 0.0, True, {"end_reason": reason})

  @staticmethod
  async def _after_replay(state: EpisodeState, coroutine):
    if state.replayed is not None:  # a resumed episode's environment is rebuilt first
      await asyncio.wrap_future(state.replayed)
    return await coroutine

  def on_event(self, ev: EnvEvent, group: Group) -> EventOutcome:
    """Applies an environment's result to its group (a queued turn's request goes to
    `group.records[j]`); says what the controller does next."""
    states, records = group.episodes, group.records
    state = states[ev.index]
    if ev.kind == "reset":
      try:
        ids = prompt_ids(
          self.tokenizer, ev.future.result(), state.episode.tools, self.template_kwargs
        )
        if len(ids) >= self.max_tokens:
          raise EnvError(
            f"its first prompt has {len(ids)} ids, no room for a turn under max_tokens="
            f"{self.max_tokens} (config.env.max_tokens)"
          )
      except Exception as e:  # EnvError from the episode, or the template
        for s in states:
          if s.episode is not None:
            s.episode.close()
        return EventOutcome(failed=str(e))
      state.trajectory = Trajectory.start(group.prompt, ids)
      state.phase = "turn"
      if any(s.phase == "reset" for s in states):
        return EventOutcome()
      for j, s in enumerate(states):
        records[j] = self._turn(records[j], s)
      return EventOutcome(queued=list(range(len(states))))
    try:
      step = ev.future.result()
    except Exception as e:  # the episode was misused (a bug here, or a replay that diverged)
      log.exception("environment step of group %d response %d failed", ev.gid, ev.index)
      self._end(state, "env_error", f"{type(e).__name__}: {e}")
      return EventOutcome(ended=[ev.index])
    if step.done:
      self._end(state, None)
      return EventOutcome(ended=[ev.index])
    kwargs = dict(tools=state.episode.tools, template_kwargs=self.template_kwargs)
    try:
      fits = append_answer(
        state.trajectory, step.messages, self.tokenizer, **kwargs, max_tokens=self.max_tokens
      )
    except EnvError as e:
      state.episode.fail("env_error", str(e))
      self._end(state, None)
      return EventOutcome(ended=[ev.index])
    if not fits:
      self._end(state, "max_tokens")
      return EventOutcome(ended=[ev.index])
    records[ev.index] = self._turn(records[ev.index], state)
    return EventOutcome(queued=[ev.index])

  def _turn(self, last: RequestRecord, state: EpisodeState) -> RequestRecord:
    """The request of the next turn (same id and base seed as the response's first)."""
    state.phase = "turn"
    return turn_request(
      state.trajectory, last.request_id, self.sampling, last.seed, self.max_tokens
    )

  def _end(self, state: EpisodeState, reason: str | None, error: str | None = None) -> None:
    if reason is not None:
      state.episode.end(reason)
      if error:
        log.warning("episode ended (%s): %s", reason, error)
    state.phase = "done"
    state.trajectory.summary = state.episode.summary()

  # -- checkpoints -------------------------------------------------------------------------------

  def restore(self, group: Group) -> list[int]:
    """Rebuilds a resumed group's open episodes (see the module docstring); returns the
    responses whose turn is to be queued again."""
    gid, record = group.gid, group.prompt
    if any(s.phase == "reset" for s in group.episodes):
      self._reset(group)
      return []
    queued = []
    for j, state in enumerate(group.episodes):
      if state.phase == "done":
        continue
      state.episode = self._episode()
      actions = list(state.trajectory.actions)
      if state.phase == "env":
        # The step that was running is taken again once the rest is replayed.
        *actions, last = actions
        state.replayed = self.runner.submit(self._replay(state.episode, record, actions))
        self._submit(gid, j, "step", self._after_replay(state, state.episode.step(last)))
      else:
        state.replayed = self.runner.submit(self._replay(state.episode, record, actions))
        queued.append(j)
    return queued

  @staticmethod
  async def _replay(episode: Episode, record: dict[str, Any], actions: Sequence[str]) -> None:
    await episode.reset(dict(record))
    for action in actions:
      await episode.step(action)

  # -- training and evaluation -------------------------------------------------------------------

  def batch(self, trajectories: Sequence[Trajectory], advantages_b: np.ndarray) -> TrainBatch:
    return trajectory_batch(trajectories, advantages_b, self.tokenizer.pad_id)

  def evaluate(
    self, engine: PagedEngine, records: Sequence[dict], sampling: SamplingParams, seed: int
  ) -> dict[str, float]:
    """Plays one episode per held-out record on `engine`: the mean episode reward
    (`eval_reward`; a record whose environment cannot start scores 0), turns and the
    fraction that a limit cut off."""
    rollout = MultiTurnRollout(
      engine,
      self.tokenizer,
      self.make_env,
      self.limits,
      max_tokens=self.max_tokens,
      template_kwargs=self.template_kwargs,
      env_threads=self.cfg.env.threads,
    )
    result = rollout.run(records, sampling, seed=seed)
    rewards = [t.reward for t in result.trajectories] + [0.0] * len(result.skipped)
    summaries = [t.summary for t in result.trajectories]
    return {
      "eval_reward": float(np.mean(rewards)),
      "eval_turns": float(np.mean([s.turns for s in summaries])) if summaries else 0.0,
      "eval_truncated_frac": float(np.mean([s.truncated for s in summaries])) if summaries else 0.0,
      "eval_skipped": float(len(result.skipped)),
    }


def start_env_workers(cfg: ExperimentConfig) -> EnvWorkers | None:
  """The environment workers `config.env.run_in` asks for (None: "threads", in this process).

  Raises:
    ConfigError: "ray" without Ray installed.
  """
  env = cfg.env
  if env.run_in == "threads":
    return None
  if env.run_in == "processes":
    return env.start_workers()
  try:
    from jaxrl.envs.ray_envs import actor_workers
  except ImportError:
    raise ConfigError(
      "config.env.run_in='ray' needs Ray: pip install 'jaxrl[ray]' (or set env.run_in='processes')."
    ) from None
  init_ray(cfg.loop.ray_address)
  return actor_workers(
    env.name,
    env.kwargs,
    count=env.workers,
    memory_mb=env.worker_memory_mb,
    threads=env.threads,
    resources=env.worker_resources,
  )


def check_environment(
  cfg: ExperimentConfig, tokenizer: Tokenizer, template_kwargs, record: dict[str, Any]
) -> None:
  """Checks once, before a multi-turn run starts, that the chat template can show the model
  the environment's tools and that the environment starts on `record` (a training record of
  `config.task`): a task whose records it cannot start would drop every group, forever.

  Raises:
    ConfigError: it cannot (names `config.env.name`, `config.task.name` and why).
  """
  env = cfg.env.make_env()()
  try:
    try:
      check_tools_render(tokenizer, [dict(t) for t in env.tools], template_kwargs)
    except EnvError as e:
      raise ConfigError(f"config.env.name={cfg.env.name!r}: {e}") from None
    try:
      asyncio.run(run_reset(env, record, _RESET_CHECK_S))
    except Exception as e:  # what the environment's reset raised
      raise ConfigError(
        f"config.env.name={cfg.env.name!r} cannot start on the records of "
        f"config.task.name={cfg.task.name!r}: {e}. Choose the task the environment is made for."
      ) from None
  finally:
    env.close()


def scripted_trajectories(
  cfg: ExperimentConfig,
  tokenizer: Tokenizer,
  records: Sequence[dict[str, Any]],
  *,
  seed: int,
  max_tokens: int,
  template_kwargs: dict[str, Any],
) -> list[Trajectory]:
  """Episodes of `config.env` played by its scripted policy (`Environment.scripted_action`),
  rendered token for token as rollout renders them: each scripted turn and the template's end
  of turn after it (`end_of_turn_id`) are the "sampled" ids (a supervised warm-up trains on
  them), everything else is context.
  An episode is cut where it would pass `max_tokens`.

  Raises:
    ConfigError: the environment has no scripted policy.
  """
  make_env = cfg.env.make_env()

  async def play(i: int, record: dict[str, Any]) -> Trajectory:
    rng = np.random.default_rng([seed, i])
    env = make_env()
    episode = Episode(env, cfg.env.limits)
    first = await episode.reset(dict(record))
    kwargs = dict(tools=episode.tools, template_kwargs=template_kwargs)
    trajectory = Trajectory.start(record, prompt_ids(tokenizer, first, **kwargs))
    stop = end_of_turn_id(tokenizer, **kwargs)
    while not episode.done:
      action = env.scripted_action(rng)
      if action is None:
        episode.close()
        raise ConfigError(
          f"config.env.name={cfg.env.name!r} has no scripted policy (scripted_action) for a "
          "supervised warm-up; set config.warmup.steps=0, or define scripted_action."
        )
      ids = [*tokenizer.encode(action), stop]
      if len(trajectory.token_ids) + len(ids) > max_tokens:
        episode.end("max_tokens")
        break
      trajectory.append(ids, [0.0] * len(ids), [0] * len(ids))
      trajectory.turns += 1
      trajectory.actions.append(action)
      trajectory.last_stop = stop
      step = await episode.step(action)
      if not step.done and not append_answer(
        trajectory, step.messages, tokenizer, **kwargs, max_tokens=max_tokens
      ):
        episode.end("max_tokens")
    trajectory.summary = episode.summary()
    return trajectory

  async def play_all() -> list[Trajectory]:
    return list(await asyncio.gather(*(play(i, r) for i, r in enumerate(records))))

  return asyncio.run(play_all())


def trajectory_max_tokens(cfg: ExperimentConfig, max_seq_len: int) -> int:
  """Ids a trajectory may hold: `config.env.max_tokens`, at most the model's `max_seq_len`."""
  return min(cfg.env.max_tokens or max_seq_len, max_seq_len)


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Reward, length, turn and end-reason statistics of a trained batch of episodes."""
  summaries = [t.summary for t in trajectories]
  rewards = np.asarray([t.reward for t in trajectories])
  reasons = collections.Counter(s.end_reason for s in summaries)
  return {
    "reward_mean": float(rewards.mean()),
    "reward_std": float(rewards.std()),
    "response_length": float(np.mean([sum(t.sampled) for t in trajectories])),
    "trajectory_length": float(np.mean([len(t.token_ids) for t in trajectories])),
    "turns": float(np.mean([s.turns for s in summaries])),
    "tool_calls": float(np.mean([s.tool_calls for s in summaries])),
    "truncated_frac": float(np.mean([s.truncated for s in summaries])),
    "env_failed_frac": float(np.mean([s.error is not None for s in summaries])),
    **{f"end_{reason}": n / len(summaries) for reason, n in sorted(reasons.items())},
  }
