"""Environments that misbehave on purpose, for the tests of environment workers
(`jaxrl.envs.remote`): importable by name in a spawned worker process."""

import os
import signal
import time

from jaxrl.envs import EndEpisode, Environment, Step


class Misbehaving(Environment):
  """Answers "ok" to each turn and does what the action says: "crash" kills its process,
  "alloc N" allocates N MiB, "hang" sleeps past any timeout, "end" ends the episode with the
  reason "tool_refused", "pid" tells its process id, "done" ends the episode."""

  def reset(self, record):
    return [{"role": "user", "content": f"episode {record['id']}"}]

  def step(self, action):
    if action == "crash":
      os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("alloc "):
      block = bytearray(int(action.split()[1]) << 20)
      return Step([{"role": "user", "content": f"allocated {len(block) >> 20} MiB"}], 0.5)
    if action == "hang":
      time.sleep(60)
    if action == "end":
      raise EndEpisode("tool_refused", "the tool said no")
    if action == "pid":
      return Step([{"role": "user", "content": str(os.getpid())}], 0.0)
    return Step([{"role": "user", "content": "ok"}], 1.0, action == "done")


class FailsToStart(Environment):
  def __init__(self):
    raise RuntimeError("no licence for this simulator")

  def reset(self, record):
    return []

  def step(self, action):
    return Step()
