"""What a run shows its user: metrics to JSONL and TensorBoard, and the reward-curve plot."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping

import numpy as np


class MetricsWriter:
  """Appends one JSON object per record to `<workdir>/metrics.jsonl` and mirrors scalars to
  TensorBoard under `<workdir>/tensorboard`."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
    self._tb = None
    if tensorboard:
      self._tb = _summary_writer_class()(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, kind: str, values: Mapping[str, float]) -> None:
    """Writes one record; `kind` ("train", "eval", "warmup") prefixes the TensorBoard tags."""
    record = {"step": int(step), "kind": kind}
    record.update({k: _scalar(v) for k, v in values.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k not in ("step", "kind") and isinstance(v, float) and math.isfinite(v):
          self._tb.add_scalar(f"{kind}/{k}", v, step)

  def truncate_after(self, step: int) -> None:
    """Drops the train and eval records past `step`: a run resumed from the checkpoint of
    `step` writes them again (warm-up records stay). TensorBoard's event files keep theirs."""
    self._file.close()
    records = read_metrics(self.path)  # without a last record cut short by a kill
    kept = [r for r in records if r["kind"] not in ("train", "eval") or r["step"] <= step]
    partial = self.path + ".partial"
    with open(partial, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(partial, self.path)  # a kill now leaves the old file or the new one
    self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

  def recorded(self, kind: str, step: int) -> dict | None:
    """The last record of `kind` at `step` written so far (a resumed run's), or None."""
    found = [r for r in read_metrics(self.path) if r["kind"] == kind and r["step"] == step]
    return found[-1] if found else None

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch, where it
  is installed, only to accept torch tensors, which this writer never gets; that import took
  4.5 s and 610 MB of the process's memory on the 2-core VM (and on a GPU machine it loads
  torch's CUDA libraries into the process beside JAX's). A process that imported torch already
  keeps it."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter

    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX goes on without
  try:
    from tensorboardX import SummaryWriter
  finally:
    if "torch" in sys.modules and sys.modules["torch"] is None:
      del sys.modules["torch"]
  return SummaryWriter


def _scalar(value):
  if isinstance(value, str | int | bool):
    return value
  return float(np.asarray(value))


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics.jsonl (none if it does not exist); a last line cut short by a
  killed process is left out."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  records = []
  for i, line in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise ValueError(f"{path}:{i + 1}: not a JSON record: {line[:80]!r}") from None
  return records


def plot_reward_curve(metrics_path: str, png_path: str, title: str = "GRPO") -> None:
  """Training reward per step and held-out eval reward, from a metrics.jsonl, into a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_metrics(metrics_path)
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(
      [r["step"] for r in train],
      [r["reward_mean"] for r in train],
      alpha=0.5,
      label="train reward (sampled)",
    )
  if evals:
    ax.plot(
      [r["step"] for r in evals],
      [r["eval_reward"] for r in evals],
      "o-",
      label="held-out eval reward",
    )
  ax.set_xlabel("RL step")
  ax.set_ylabel("reward")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
