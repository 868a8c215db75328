"""Benchmarks behind docs/BENCHMARKS.md.

  python launch/bench.py logprob_mismatch [--json]

Each benchmark prints a table (or one JSON object with --json) and the machine it ran on.
"""

import argparse
import json
import platform
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxrl.model import Model, get_preset  # noqa: E402
from jaxrl.rl.experience import logprob_mismatch  # noqa: E402
from jaxrl.rollout import SamplingParams, StaticEngine  # noqa: E402
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh  # noqa: E402
from jaxrl.train import Learner, LossConfig, OptimizerConfig  # noqa: E402


def bench_logprob_mismatch(num_seqs: int = 64, max_new_tokens: int = 32) -> dict:
  """|rollout log-prob - learner log-prob| per generated token, same weights, fp32."""
  devices = jax.devices()
  rollout_mesh = make_mesh(devices[:4], {"data": 2, "tensor": 2})
  train_mesh = make_mesh(devices[4:8], {"fsdp": 4})
  out = {}
  for preset in ("tiny", "tiny-moe"):
    model = Model(get_preset(preset))
    params = model.init(0)
    engine = StaticEngine(model, rollout_mesh, ROLLOUT_RULES, eos_id=2, pad_id=0)
    engine.update_weights(params, 0)
    learner = Learner(
      model,
      train_mesh,
      TRAIN_RULES,
      loss=LossConfig(),
      optimizer=OptimizerConfig(),
      updates_per_step=1,
      micro_batch_size=num_seqs,
      temperature=1.0,
      params=params,
    )
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 60, rng.integers(2, 12))) for _ in range(num_seqs)]
    completions = engine.generate(
      prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), seed=0
    )
    out[preset] = logprob_mismatch(learner, completions, pad_id=0)
  return out


BENCHMARKS = {"logprob_mismatch": bench_logprob_mismatch}


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("name", choices=sorted(BENCHMARKS))
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args()
  result = BENCHMARKS[args.name]()
  if args.json:
    print(json.dumps(result))
    return
  print(
    f"{args.name} on {platform.processor() or platform.machine()}, "
    f"{len(jax.devices())} {jax.default_backend()} devices, jax {jax.__version__}"
  )
  for key, row in result.items():
    print(
      f"  {key}: "
      + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    )


if __name__ == "__main__":
  sys.exit(main())
