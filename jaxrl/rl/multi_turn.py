"""Multi-turn rollouts: the paged engine decodes, environments answer, token in, token out.

A trajectory starts from its environment's first messages (`envs.prompt_ids`) and alternates
model turns and environment steps. A model turn is one request on the engine whose prompt is
the whole trajectory so far; when it stops (a stop id or the turn's length limit), its ids,
log-probs and policy versions are appended to the trajectory as sampled, its text goes to the
environment's `Episode.step`, and the environment's messages come back as template ids
(`envs.continuation_ids`) appended unsampled. Nothing is re-tokenised: the learner trains on
exactly the ids the engine drew (`trajectory_batch`: loss mask 1 on sampled ids only, rollout
log-probs as the behaviour policy's, per token, across turns and weight versions).

Tool latency stays off the decode loop: environment steps run on an event loop thread (an
`async def` step there, a plain one in a thread pool, each under `EpisodeLimits.step_timeout_s`)
while the engine keeps decoding the other trajectories; a trajectory waiting for its environment
holds no decode row. Its KV pages stay parked in the engine while memory allows
(`RequestRecord.keep_kv`, `PagedConfig.keep_turn_kv`): every turn of a trajectory is a request
with the same id, so the next turn prefills only the environment's answer; evicted pages (the
engine needed them) are prefilled again, as after a preemption. A step that fails or hangs ends
that episode only, with the reason recorded; its tokens are kept.

Glossary: b trajectories, t positions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs import (
  EnvError,
  Environment,
  Episode,
  EpisodeLimits,
  EpisodeSummary,
  continuation_ids,
  prompt_ids,
)
from jaxrl.envs.runner import EnvRunner
from jaxrl.rl.experience import batch_length
from jaxrl.rollout.paged import PagedEngine
from jaxrl.rollout.requests import RequestRecord
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.train.batch import TrainBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trajectory:
  """One episode as token ids.

  Attributes:
    record: the dataset record it started from.
    token_ids: every id in order: the first prompt, then each model turn and each environment
      continuation.
    sampled: per id, 1 if the policy sampled it (a model turn), 0 if not (prompt, environment
      messages, template glue).
    logprobs: per id, the log-probability it was sampled with (0 where not sampled).
    versions: per id, the policy version that sampled it (-1 where not sampled).
    prompt_len: ids of the first prompt.
    turns: model turns taken.
    actions: the text of each turn the environment was given (what a resumed run replays to
      rebuild the environment).
    last_stop: the stop id the last turn ended on (None: cut off by a length limit), which the
      environment's continuation does not repeat.
    summary: the episode's end reason, rewards and tool calls (`Episode.summary`).
    routes: MoE models only (else empty): for each id but the last, the experts each layer
      chose for it as an input (`[layer][k]`), as the engine traced them: the first turn to
      feed an id routed it (its prefill, or the decode step that sampled the next id), and
      later turns carry those routes on (`turn_request`). The learner's routing replay sends
      the trajectory through them.
  """

  record: dict[str, Any]
  token_ids: list[int]
  sampled: list[int]
  logprobs: list[float]
  versions: list[int]
  prompt_len: int
  turns: int = 0
  actions: list[str] = dataclasses.field(default_factory=list)
  last_stop: int | None = None
  summary: EpisodeSummary | None = None
  routes: list[list[list[int]]] = dataclasses.field(default_factory=list)

  @classmethod
  def start(cls, record: dict[str, Any], prompt: Sequence[int]) -> Trajectory:
    """A trajectory of its first prompt's ids."""
    trajectory = cls(dict(record), [], [], [], [], prompt_len=len(prompt))
    trajectory.append(prompt)
    return trajectory

  @property
  def sampled_versions(self) -> np.ndarray:
    """The policy versions of the sampled ids."""
    return np.asarray([v for v, s in zip(self.versions, self.sampled, strict=True) if s], np.int32)

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable (checkpoints)."""
    d = dataclasses.asdict(self)
    d["summary"] = None if self.summary is None else dataclasses.asdict(self.summary)
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Trajectory:
    d = dict(d)
    summary = d.pop("summary", None)
    trajectory = cls(**d)
    if summary is not None:
      trajectory.summary = EpisodeSummary(**{**summary, "rewards": tuple(summary["rewards"])})
    return trajectory

  @property
  def reward(self) -> float:
    return 0.0 if self.summary is None else self.summary.reward

  def append(self, ids: Sequence[int], logprobs=None, versions=None) -> None:
    """Appends ids: sampled ones with their log-probs and versions, else unsampled."""
    self.token_ids.extend(int(i) for i in ids)
    self.sampled.extend([1 if logprobs is not None else 0] * len(ids))
    self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
    self.versions.extend(versions if versions is not None else [-1] * len(ids))


def turn_request(
  trajectory: Trajectory,
  request_id: str,
  sampling: SamplingParams,
  seed: int,
  max_tokens: int,
) -> RequestRecord:
  """The engine request of the trajectory's next model turn: its prompt is the whole
  trajectory so far, and the turn may use what `max_tokens` leaves. `request_id` is the
  trajectory's (the same every turn) and the request keeps its KV pages when it ends
  (`keep_kv`): the episode may go on, and its next turn then reuses them. An MoE
  trajectory's routes so far go with it as the prompt's (`prompt_routing`), so the engine
  traces only the ids no turn has fed yet: where its pages were dropped (new weights,
  eviction) and the prompt is prefilled again, the ids the earlier turns sampled keep the
  routes they were sampled with."""
  room = max_tokens - len(trajectory.token_ids)
  return RequestRecord(
    request_id=request_id,
    prompt_ids=list(trajectory.token_ids),
    sampling=dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room)),
    seed=turn_seed(seed, trajectory.turns),
    prompt_routing=list(trajectory.routes),
    keep_kv=True,
  )


def turn_seed(seed: int, turn: int) -> int:
  """The sampling seed of a trajectory's turn `turn`, from the trajectory's seed."""
  return (seed * 1009 + turn) % (2**31 - 1)


def end_turn(
  trajectory: Trajectory, record: RequestRecord, tokenizer: Tokenizer, max_tokens: int
) -> str | None:
  """Appends a finished turn's ids as sampled; returns its text for the environment (stop id
  left out), or None when the turn was cut off with no room for more (the episode ends
  "max_tokens"). A turn that ends on its stop id in the last slot is complete: the
  environment gets it (an answer scores; anything it asks for then finds no room)."""
  trajectory.append(record.token_ids, list(record.logprobs), list(record.versions))
  trajectory.turns += 1
  if record.routing:  # MoE: the turn's trace covers every id it fed, the earlier turns' too
    routes = [*record.prompt_routing, *record.routing]
    if len(routes) != len(trajectory.token_ids) - 1:
      raise ValueError(
        f"Turn {trajectory.turns} of {record.request_id} traced routes for {len(routes)} "
        f"inputs; its trajectory feeds {len(trajectory.token_ids) - 1} (a bug in the engine "
        "or in what the turn's request was given)."
      )
    trajectory.routes = routes
  if len(trajectory.token_ids) >= max_tokens and record.finish_reason != "stop":
    return None
  ids = record.token_ids
  ended_on_stop = record.finish_reason == "stop"  # the engine's stop ids, EOS unless ignored
  trajectory.last_stop = ids[-1] if ended_on_stop else None
  text = tokenizer.decode(ids[:-1] if ended_on_stop else ids)
  trajectory.actions.append(text)
  return text


def append_answer(
  trajectory: Trajectory,
  messages: Sequence[Mapping[str, Any]],
  tokenizer: Tokenizer,
  *,
  tools: Sequence[Mapping[str, Any]],
  template_kwargs: Mapping[str, Any],
  max_tokens: int,
) -> bool:
  """Appends the environment's messages as template ids (not sampled); False, appending
  nothing, when they and a turn after them would not fit `max_tokens` (nothing would be
  trained on them: the episode ends "max_tokens").

  Raises:
    EnvError: the messages cannot be rendered (the tokenizer or the chat template refuses
      them): the environment's fault, which ends its episode only.
  """
  try:
    ids = continuation_ids(
      tokenizer,
      messages,
      stop_id=trajectory.last_stop,
      tools=tools,
      template_kwargs=template_kwargs,
    )
  except Exception as e:
    raise EnvError(f"its messages cannot be rendered: {type(e).__name__}: {e}") from e
  if len(trajectory.token_ids) + len(ids) >= max_tokens:
    return False
  trajectory.append(ids)
  return True


@dataclasses.dataclass
class MultiTurnResult:
  """What `MultiTurnRollout.run` made: a trajectory per record that could start, and the
  records whose environment could not (reset failed), with why."""

  trajectories: list[Trajectory]
  skipped: list[tuple[dict[str, Any], str]]


class MultiTurnRollout:
  """Runs episodes of an environment on a paged engine.

  Args:
    engine: the paged engine (its weights set by the caller, `update_weights`, at any time).
    tokenizer: renders the environment's messages (its chat template, or plain text).
    make_env: a fresh environment per trajectory (`envs.env_factory(EnvConfig)`).
    limits: each episode's turns, tool calls and step timeout.
    max_tokens: ids a trajectory may hold (prompt, turns and continuations); the episode ends
      with "max_tokens" when the next turn would find no room.
    template_kwargs: chat template variables (e.g. {"enable_thinking": False}).
    env_threads: threads for environments' plain (not `async`) methods.
  """

  def __init__(
    self,
    engine: PagedEngine,
    tokenizer: Tokenizer,
    make_env: Callable[[], Environment],
    limits: EpisodeLimits,
    *,
    max_tokens: int,
    template_kwargs: Mapping[str, Any] | None = None,
    env_threads: int = 8,
  ):
    if max_tokens < 2:
      raise ValueError(f"max_tokens must be >= 2 (a prompt and a sampled id), got {max_tokens}")
    self.engine = engine
    self.tokenizer = tokenizer
    self.make_env = make_env
    self.limits = limits
    self.max_tokens = min(max_tokens, engine.model.config.max_seq_len)
    self.template_kwargs = dict(template_kwargs or {})
    self.env_threads = env_threads
    # Hooks called with (trajectory index, Trajectory) after each model turn is appended
    # (tests use them to change weights mid-episode).
    self.on_turn: list[Callable[[int, Trajectory], None]] = []

  def run(
    self, records: Sequence[dict[str, Any]], sampling: SamplingParams, *, seed: int
  ) -> MultiTurnResult:
    """Plays one episode per record to its end; `sampling` applies to every model turn (its
    `max_new_tokens` bounds one turn). Returns when every episode has ended."""
    with EnvRunner(self.env_threads) as runner:
      return _Run(self, runner, sampling, seed).play(records)


class _Run:
  """The state of one `MultiTurnRollout.run`."""

  def __init__(self, rollout: MultiTurnRollout, runner: EnvRunner, sampling, seed: int):
    self.r = rollout
    self.runner = runner
    self.sampling = sampling
    self.seed = seed
    self.episodes: list[Episode] = []
    self.trajectories: list[Trajectory] = []
    self.waiting: dict[int, concurrent.futures.Future] = {}  # trajectory -> its env step
    self.open = 0

  def play(self, records: Sequence[dict[str, Any]]) -> MultiTurnResult:
    r = self.r
    skipped = []
    episodes = [Episode(r.make_env(), r.limits, executor=self.runner.executor) for _ in records]
    resets = [
      self.runner.submit(e.reset(dict(rec))) for e, rec in zip(episodes, records, strict=True)
    ]
    for episode, record, reset in zip(episodes, records, resets, strict=True):
      try:
        messages = reset.result()
        ids = prompt_ids(r.tokenizer, messages, episode.tools, r.template_kwargs)
        if len(ids) >= r.max_tokens:
          raise EnvError(
            f"its first prompt has {len(ids)} ids, no room for a turn under max_tokens="
            f"{r.max_tokens}"
          )
      except Exception as e:  # EnvError from the episode, or the tokenizer or template
        log.warning("record %r skipped: %s", record.get("id", "?"), e)
        skipped.append((record, str(e)))
        episode.close()
        continue
      self.episodes.append(episode)
      self.trajectories.append(Trajectory.start(record, ids))
      self.open += 1
      self._next_turn(len(self.trajectories) - 1)
    while self.open:
      if not r.engine.has_work and not self.waiting:
        raise RuntimeError(f"{self.open} episodes neither decoding nor waiting: a bug")
      finished = r.engine.step() if r.engine.has_work else []
      for record in finished:
        self._turn_done(int(record.request_id.split(".")[1]), record)
      if not r.engine.has_work and self.waiting:
        # Nothing to decode: wait for an environment (each step has its own timeout).
        concurrent.futures.wait(list(self.waiting.values()), return_when="FIRST_COMPLETED")
      for index in [i for i, f in self.waiting.items() if f.done()]:
        self._env_done(index, self.waiting.pop(index).result())
    return MultiTurnResult(self.trajectories, skipped)

  def _next_turn(self, index: int) -> None:
    trajectory = self.trajectories[index]
    seed = (self.seed * 1_000_003 + index) % (2**31 - 1)
    rid = f"traj.{index}"  # one id for all its turns: the next one finds the kept pages
    self.r.engine.submit(turn_request(trajectory, rid, self.sampling, seed, self.r.max_tokens))

  def _turn_done(self, index: int, record: RequestRecord) -> None:
    trajectory = self.trajectories[index]
    text = end_turn(trajectory, record, self.r.tokenizer, self.r.max_tokens)
    for hook in self.r.on_turn:
      hook(index, trajectory)
    if text is None:
      self._finish(index, "max_tokens")
      return
    self.waiting[index] = self.runner.submit(self.episodes[index].step(text))

  def _env_done(self, index: int, step) -> None:
    episode, trajectory = self.episodes[index], self.trajectories[index]
    if step.done:
      self._finish(index, None)
      return
    kwargs = dict(tools=episode.tools, template_kwargs=self.r.template_kwargs)
    try:
      fits = append_answer(
        trajectory, step.messages, self.r.tokenizer, **kwargs, max_tokens=self.r.max_tokens
      )
    except EnvError as e:
      episode.fail("env_error", str(e))
      self._finish(index, None)
      return
    if not fits:
      self._finish(index, "max_tokens")
      return
    self._next_turn(index)

  def _finish(self, index: int, reason: str | None) -> None:
    self.r.engine.drop_kept(f"traj.{index}")  # no next turn will reuse its pages
    episode = self.episodes[index]
    if reason is not None:
      episode.end(reason)
    self.trajectories[index].summary = episode.summary()
    self.open -= 1


def trajectory_batch(
  trajectories: Sequence[Trajectory],
  advantages_b: np.ndarray,
  pad_id: int,
  length: int | None = None,
) -> TrainBatch:
  """The learner's batch: each row a trajectory's ids, the loss mask on the targets the policy
  sampled (every other id is context), rollout log-probs as the behaviour policy's, and (MoE)
  the routes of its inputs for routing replay (-1 past them: padding, and the environment's
  last answer where the episode ended after it, which no turn fed and no target follows).
  `length` fixes the padded row length (default: `batch_length` of the longest)."""
  longest = max(len(t.token_ids) for t in trajectories)
  length = batch_length(longest) if length is None else length
  if longest > length:
    raise ValueError(f"A trajectory of {longest} ids does not fit the batch length {length}.")
  b = len(trajectories)
  tokens_bt = np.full((b, length), pad_id, np.int32)
  mask_bt = np.zeros((b, length - 1), np.float32)
  old_logp_bt = np.zeros((b, length - 1), np.float32)
  for i, t in enumerate(trajectories):
    n = len(t.token_ids)
    tokens_bt[i, :n] = t.token_ids
    # Target position j predicts id j + 1.
    mask_bt[i, : n - 1] = t.sampled[1:]
    old_logp_bt[i, : n - 1] = t.logprobs[1:]
  routes_btlk = None
  if all(t.routes for t in trajectories):
    layers, k = np.shape(trajectories[0].routes[0])
    routes_btlk = np.full((b, length - 1, layers, k), -1, np.int32)
    for i, t in enumerate(trajectories):
      routes_btlk[i, : len(t.routes)] = t.routes
  advantages_b = np.asarray(advantages_b, np.float32)
  return TrainBatch(tokens_bt, mask_bt, old_logp_bt, advantages_b, routes_btlk)
