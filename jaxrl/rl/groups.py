"""A GRPO group as the RL loop tracks it: one prompt, its responses' records, their rewards.

The controller keeps the last streamed copy of every request in its group (the single source of
truth for what has been generated); request ids name the group and the response ("g12.3"). In a
multi-turn run (`config.env`) each response is an episode (`EpisodeState`): its record is the
request of its current turn, its trajectory holds every turn so far.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.envs import Episode
from jaxrl.rl.multi_turn import Trajectory
from jaxrl.rollout.requests import RequestRecord


@dataclasses.dataclass
class EpisodeState:
  """One response of a multi-turn group: its phase ("reset", "turn", "env" or "done";
  `jaxrl.rl.episodes`), its trajectory and its live environment."""

  phase: str = "reset"
  trajectory: Trajectory | None = None  # from the end of its reset
  episode: Episode | None = None  # the live environment (not saved)
  replayed: concurrent.futures.Future | None = None  # a resumed run's replay, until it ends

  def to_dict(self) -> dict[str, Any]:
    t = self.trajectory
    return {"phase": self.phase, "trajectory": None if t is None else t.to_dict()}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> EpisodeState:
    t = d["trajectory"]
    return cls(d["phase"], None if t is None else Trajectory.from_dict(t))


@dataclasses.dataclass
class Group:
  """A prompt's responses as the controller last saw them."""

  gid: int
  prompt: dict
  version: int  # the learner's version when the group was released
  records: list[RequestRecord]
  done: list[bool]
  rewards: np.ndarray | None = None
  episodes: list[EpisodeState] | None = None  # multi-turn runs: one per response

  @property
  def finished(self) -> bool:
    return all(self.done)

  @property
  def trajectories(self) -> list[Trajectory]:
    """Multi-turn: each response's trajectory (once its episode has started)."""
    return [e.trajectory for e in self.episodes]

  def oldest_version(self) -> int:
    versions = [min(r.versions) for r in self.records if r.versions]
    for e in self.episodes or ():
      if e.trajectory is not None and len(e.trajectory.sampled_versions):
        versions.append(int(e.trajectory.sampled_versions.min()))
    return min(versions, default=self.version)

  def to_dict(self) -> dict:
    d = {
      "gid": self.gid,
      "prompt": self.prompt,
      "version": self.version,
      "records": [r.to_dict() for r in self.records],
      "done": list(self.done),
    }
    if self.episodes is not None:
      d["episodes"] = [e.to_dict() for e in self.episodes]
    return d

  @classmethod
  def from_dict(cls, d: dict) -> Group:
    episodes = d.get("episodes")
    return cls(
      gid=d["gid"],
      prompt=d["prompt"],
      version=d["version"],
      records=[RequestRecord.from_dict(r) for r in d["records"]],
      done=list(d["done"]),
      episodes=None if episodes is None else [EpisodeState.from_dict(e) for e in episodes],
    )

  @classmethod
  def load_all(cls, state: dict, group_size: int) -> list[Group]:
    """The groups of a checkpoint's controller state (popped from `state`, with the group size
    it was written with), which must be `group_size` (`config.rollout.group_size`) responses
    each: their advantages would be computed over the wrong groups."""
    saved = state.pop("group_size", None)  # None: an older checkpoint, which had no record
    dicts = state.pop("groups", [])
    sizes = {saved} if saved is not None else {len(d["records"]) for d in dicts}
    if sizes - {group_size}:
      raise ConfigError(
        f"config.rollout.group_size is {group_size}, but the checkpoint's groups have "
        f"{', '.join(map(str, sorted(sizes)))} responses. Resume with "
        f"--config.rollout.group_size={min(sizes)}, or start a new run in an empty --workdir."
      )
    return [cls.from_dict(d) for d in dicts]


def request_id(gid: int, j: int) -> str:
  return f"g{gid}.{j}"


def parse_request_id(rid: str) -> tuple[int, int]:
  gid, j = rid[1:].split(".")
  return int(gid), int(j)


def sampling_seed(seed: int, index: int) -> int:
  """A sampling seed that depends only on (seed, index), so a resumed run samples the same."""
  return (seed * 1_000_003 + index + 1) % (2**31 - 1)


def batch_metrics(rewards_b: np.ndarray, completions) -> dict[str, float]:
  """Reward and length statistics of a trained batch."""
  return {
    "reward_mean": float(rewards_b.mean()),
    "reward_std": float(rewards_b.std()),
    "response_length": float(np.mean([len(c.token_ids) for c in completions])),
    "truncated_frac": float(np.mean([c.finish_reason == "length" for c in completions])),
  }
