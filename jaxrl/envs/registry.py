"""Environments by name: the shipped ones, and a user's class named `package.module:ClassName`.

`EnvConfig(name, kwargs, limits)` says which environment a run uses; `env_factory(cfg)` checks
the name and the constructor's arguments once (an error names the environment and what to
change) and returns a function that makes a fresh environment per trajectory.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.envs.base import EnvError, Environment
from jaxrl.envs.episode import EpisodeLimits
from jaxrl.envs.guess_number import DelayedGuessNumberEnv, GuessNumberEnv
from jaxrl.envs.python_tool import PythonToolEnv
from jaxrl.envs.remote import EnvWorkers, process_workers

ENVIRONMENTS: dict[str, type[Environment]] = {
  "guess_number": GuessNumberEnv,
  "guess_number_delayed": DelayedGuessNumberEnv,
  "python_tool": PythonToolEnv,
}


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Which environment a multi-turn run uses (`config.env`).

  Attributes:
    name: a key of ENVIRONMENTS, or "package.module:ClassName" for a class of your own (a
      subclass of `jaxrl.envs.Environment`); "" for single-turn tasks (no environment). The
      records an episode starts from are the task's (`config.task`).
    kwargs: keyword arguments of the environment's constructor: a dict in the config file;
      on the command line `--config.env.kwargs.KEY=VALUE` changes a key the file sets.
    limits: bounds on each episode (turns, tool calls, a step's timeout, the failure reward).
    max_tokens: ids a trajectory may hold (first prompt, turns, environment messages); the
      episode ends "max_tokens" when the next turn would find no room. 0: the model's
      `max_seq_len`. A turn's own limit is `rollout.sampling.max_new_tokens`.
    threads: threads that run environments' plain (not `async`) methods at once (in each
      worker, when they run in workers).
    run_in: where environments run: "threads" (this process: the shipped environments spend
      their time in a sandbox subprocess or a sleep, not holding the GIL), "processes"
      (`workers` spawned worker processes: an environment that crashes, leaks or computes in
      Python does not touch the learner or the engine) or "ray" (`workers` Ray actors, e.g. on
      CPU nodes; Ray starts locally unless `loop.ray_address` names a cluster).
    workers: worker processes or Ray actors (with run_in "processes" or "ray").
    worker_memory_mb: memory each worker may allocate beyond what it holds when it starts (its
      address space is capped: past it an environment's allocation raises MemoryError and its
      episode ends "env_error"); 0: no cap.
    worker_resources: Ray resources of each actor (run_in "ray"); "CPU" defaults to 1, e.g.
      {"CPU": 2, "jaxrl-pool-cpu": 1} to keep environments on nodes started with that resource.
  """

  name: str = ""
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  limits: EpisodeLimits = EpisodeLimits()
  max_tokens: int = 0
  threads: int = 16
  run_in: str = "threads"
  workers: int = 2
  worker_memory_mb: int = 0
  worker_resources: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.max_tokens < 0 or self.threads < 1 or self.workers < 1 or self.worker_memory_mb < 0:
      raise ValueError(
        f"env.max_tokens={self.max_tokens} (>= 0; 0: the model's max_seq_len), "
        f"env.threads={self.threads} (>= 1), env.workers={self.workers} (>= 1) and "
        f"env.worker_memory_mb={self.worker_memory_mb} (>= 0; 0: no cap): one is out of range."
      )
    if self.run_in not in RUN_IN:
      raise ValueError(f"env.run_in={self.run_in!r}: use one of {list(RUN_IN)}.")
    if self.worker_memory_mb and not sys.platform.startswith("linux"):
      raise ValueError(
        f"env.worker_memory_mb={self.worker_memory_mb}: the cap needs Linux; set it to 0."
      )
    if self.name:
      env_factory(self.name, self.kwargs)

  def make_env(self) -> Callable[[], Environment]:
    """A function that makes a fresh environment per trajectory in this process (`env_factory`)."""
    return env_factory(self.name, self.kwargs)

  def start_workers(self) -> EnvWorkers:
    """Starts the worker processes that `run_in="processes"` asks for; their `make_env` makes
    a fresh environment per trajectory in one of them. Close them when the run ends. (The
    Ray actors of `run_in="ray"` start from `jaxrl.envs.ray_envs.actor_workers`.)"""
    return process_workers(
      self.name,
      self.kwargs,
      count=self.workers,
      memory_mb=self.worker_memory_mb,
      threads=self.threads,
    )


RUN_IN = ("threads", "processes", "ray")


def environment_class(name: str) -> type[Environment]:
  """The class `name` stands for: a key of ENVIRONMENTS, or "package.module:ClassName".

  Raises:
    EnvError: an unknown name, a module that does not import, a class that is not there or is
      not an `Environment`; the message says what to change.
  """
  if not isinstance(name, str) or not name:
    raise EnvError(f"environment name must be a non-empty str, got {name!r}")
  if ":" not in name:
    if name in ENVIRONMENTS:
      return ENVIRONMENTS[name]
    raise EnvError(
      f"unknown environment {name!r}: the shipped environments are {sorted(ENVIRONMENTS)}; "
      "name a class of your own as 'package.module:ClassName'."
    )
  module_name, _, class_name = name.partition(":")
  if not module_name or not class_name or ":" in class_name:
    raise EnvError(f"environment {name!r} is not of the form 'package.module:ClassName'.")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
      raise EnvError(
        f"environment {name!r}: no module named {e.name!r} (is its package installed, or on "
        "PYTHONPATH?)."
      ) from e
    raise EnvError(f"environment {name!r}: importing {module_name!r} failed: {e}") from e
  except Exception as e:
    raise EnvError(
      f"environment {name!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
    ) from e
  cls = module
  for part in class_name.split("."):
    if not hasattr(cls, part):
      found = sorted(
        k
        for k, v in vars(module).items()
        if inspect.isclass(v) and issubclass(v, Environment) and v.__module__ == module.__name__
      )
      raise EnvError(
        f"environment {name!r}: module {module_name!r} has no {class_name!r}; the environments "
        f"it defines are {found}."
      )
    cls = getattr(cls, part)
  if not inspect.isclass(cls):
    raise EnvError(
      f"environment {name!r} is a {type(cls).__name__}, not a class: name a subclass of "
      "jaxrl.envs.Environment that defines reset(record) and step(action)."
    )
  if not issubclass(cls, Environment):
    raise EnvError(
      f"environment {name!r}: class {cls.__qualname__} is not a subclass of "
      "jaxrl.envs.Environment; subclass it and define reset(record) and step(action)."
    )
  if inspect.isabstract(cls):
    missing = sorted(cls.__abstractmethods__)
    raise EnvError(f"environment {name!r} does not define {missing}.")
  return cls


def env_factory(name: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
  """A function that makes a fresh environment `name` with `kwargs`, checked now.

  Raises:
    EnvError: the name does not resolve (see `environment_class`), or the constructor does not
      take these arguments.
  """
  cls = environment_class(name)
  kwargs = dict(kwargs or {})
  try:
    inspect.signature(cls).bind(**kwargs)
  except TypeError as e:
    params = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
    raise EnvError(
      f"environment {name!r} does not take the arguments {sorted(kwargs)} ({e}); its "
      f"constructor takes {params}."
    ) from None

  def make() -> Environment:
    try:
      return cls(**kwargs)
    except Exception as e:
      raise EnvError(f"environment {name!r} with {kwargs}: {type(e).__name__}: {e}") from e

  return make
