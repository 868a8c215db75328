"""A GRPO group as the RL loop tracks it: one prompt, its responses' records, their rewards.

The controller keeps the last streamed copy of every request in its group (the single source of
truth for what has been generated); request ids name the group and the response ("g12.3").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.rollout.requests import RequestRecord


@dataclasses.dataclass
class Group:
  """A prompt's responses as the controller last saw them."""

  gid: int
  prompt: dict
  version: int  # the learner's version when the group was released
  records: list[RequestRecord]
  done: list[bool]
  rewards: np.ndarray | None = None

  @property
  def finished(self) -> bool:
    return all(self.done)

  def oldest_version(self) -> int:
    return min((min(r.versions) for r in self.records if r.versions), default=self.version)

  def to_dict(self) -> dict:
    return {
      "gid": self.gid,
      "prompt": self.prompt,
      "version": self.version,
      "records": [r.to_dict() for r in self.records],
      "done": list(self.done),
    }

  @classmethod
  def from_dict(cls, d: dict) -> Group:
    return cls(
      gid=d["gid"],
      prompt=d["prompt"],
      version=d["version"],
      records=[RequestRecord.from_dict(r) for r in d["records"]],
      done=list(d["done"]),
    )


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
