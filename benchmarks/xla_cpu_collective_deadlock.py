"""Reproduces XLA:CPU's collective deadlock between simulated devices (jax 0.10.2).

A learner's packed micro-step on 4 simulated CPU devices (fsdp 2 x tensor 2) is reloaded from
the compilation cache before every update (`jax.clear_caches()`), so that each update is a
program's first run, where XLA:CPU sometimes ran a collective that follows the loop over the
blocks (without depending on it) before the loop on one device and after it on another
(`jaxrl.train.update_plan.collectives_racing_loops`). XLA then aborts the process after the
collective timeout (set to 20 s here) with "Termination timeout for `all gather
RendezvousKey{...}`". Prints the update count every 10 updates and "clean" if none hung.

    python benchmarks/xla_cpu_collective_deadlock.py [--unrolled] [--updates 400]

On a 2-core VM (2026-11-30) the scanned model deadlocked after 55 and 125 updates (once it ran
410 clean); the unrolled one ran 345 and 355 updates in two runs at once with none stuck.
"""

import argparse
import os
import sys
import tempfile
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="xla-deadlock-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ["XLA_FLAGS"] = (
  f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_collective_call_terminate_timeout_seconds=20"
)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxrl.model import Model, get_preset  # noqa: E402
from jaxrl.rl.experience import pad_sequences  # noqa: E402
from jaxrl.sharding import TRAIN_RULES, make_mesh  # noqa: E402
from jaxrl.train import Learner, LossConfig, OptimizerConfig, TrainBatch  # noqa: E402


def random_batch(rng: np.random.Generator, size: int = 16) -> TrainBatch:
  prompts = [list(rng.integers(3, 60, rng.integers(2, 8))) for _ in range(size)]
  responses = [list(rng.integers(3, 60, rng.integers(1, 9))) for _ in range(size)]
  tokens, mask = pad_sequences(prompts, responses, 0, length=24)
  old = np.where(mask > 0, rng.normal(-3.0, 0.3, mask.shape), 0.0).astype(np.float32)
  return TrainBatch(tokens, mask, old, rng.normal(size=size).astype(np.float32))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--unrolled", action="store_true", help="train with scan_layers off")
  parser.add_argument("--updates", type=int, default=400)
  args = parser.parse_args()
  config = get_preset("tiny")
  if args.unrolled:
    config = dataclasses.replace(config, scan_layers=False)
  learner = Learner(
    Model(config),
    make_mesh(jax.devices()[4:], {"fsdp": 2, "tensor": 2}),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(learning_rate=1e-3),
    updates_per_step=1,
    micro_batch_size=4,
    temperature=1.0,
    pack_length=24,
  )
  rng = np.random.default_rng(0)
  batches = [random_batch(rng) for _ in range(8)]
  start = time.time()
  for i in range(args.updates):
    jax.clear_caches()  # the next update reloads its programs: their first run again
    learner.update(batches[i % len(batches)])
    if i % 10 == 0:
      jax.block_until_ready(learner.params)
      print(f"{i} updates, {time.time() - start:.0f} s", flush=True)
  jax.block_until_ready(learner.params)
  print(f"clean: {args.updates} updates, {time.time() - start:.0f} s")


if __name__ == "__main__":
  sys.exit(main())
