# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # jaxrl quick start: GRPO on a CPU
#
# This notebook runs the `configs/grpo_tiny.py` experiment end to end: a tiny transformer learns
# to sort six digits. A short supervised warm-up gets it to about half right, then GRPO, with
# rollout on 4 devices and training on 4 others, takes it to about 0.8 on held-out prompts.
# On a CPU runtime, JAX simulates the 8 devices.
#
# Install first (from a clone of the repository): `pip install -e .`

# %%
import os

# Simulated CPU devices must be requested before JAX starts its backend.
import jax

jax.config.update("jax_num_cpu_devices", 8)

import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

from jaxrl.config import from_config_dict  # noqa: E402
from jaxrl.metrics import read_metrics  # noqa: E402
from jaxrl.rl import job  # noqa: E402

print(jax.devices())

# %% [markdown]
# ## The config
# Config files are plain Python returning an `ml_collections.ConfigDict`; `from_config_dict`
# checks every key and type once and gives frozen dataclasses. `QUICKSTART_VARIANT=test` runs
# the 3-step smoke variant (that is what the test suite does).

# %%
REPO = (
  os.path.abspath(os.path.join(os.getcwd(), ".."))
  if os.path.basename(os.getcwd()) == "notebooks"
  else os.getcwd()
)
spec = importlib.util.spec_from_file_location(
  "grpo_tiny", os.path.join(REPO, "configs", "grpo_tiny.py")
)
grpo_tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_tiny)

variant = os.environ.get("QUICKSTART_VARIANT") or None
cfg = from_config_dict(grpo_tiny.get_config(variant))
print(cfg.model)
print(cfg.placement)

# %% [markdown]
# ## Run it
# A progress bar shows the steps; metrics go to `metrics.jsonl` and TensorBoard in the workdir.

# %%
workdir = os.environ.get("QUICKSTART_WORKDIR") or tempfile.mkdtemp(prefix="jaxrl_quickstart_")
summary = job.run(cfg, workdir)
print(json.dumps(summary, indent=2))

# %% [markdown]
# ## What happened
# The held-out reward at the step-0 checkpoint (after the warm-up) and at the end, and where a
# step's time went.

# %%
records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
evals = [(r["step"], round(r["eval_reward"], 3)) for r in records if r["kind"] == "eval"]
print("eval reward by step:", evals)
last = [r for r in records if r["kind"] == "train"][-1]
print({k: round(v, 4) for k, v in last.items() if k.startswith("time_")})

# %%
try:
  from IPython.display import Image, display

  display(Image(os.path.join(workdir, "reward_curve.png")))
except ImportError:
  print("reward curve:", os.path.join(workdir, "reward_curve.png"))
