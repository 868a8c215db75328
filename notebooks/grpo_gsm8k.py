# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # GRPO on GSM8K from a Hugging Face checkpoint
#
# Post-trains `Qwen/Qwen3-0.6B` with GRPO on GSM8K on one GPU or TPU (a Colab runtime will do):
# the model and the data come from the Hugging Face Hub, answers are checked with `math-verify`,
# and the trained policy is written in Hub layout, ready for `transformers` or vLLM.
#
# Setup on Colab: choose a GPU or TPU runtime, then run the next cell with `REPO_URL` set to
# this repository (it clones it and installs `jaxrl[hf,cuda]`, or `jaxrl[hf,tpu]` on a TPU).
# Elsewhere: `pip install -e ".[hf,cuda]"` from a clone.
#
# The environment variables `GRPO_MODEL`, `GRPO_DATA`, `GRPO_VARIANT` and `GRPO_WORKDIR` replace
# the model, the dataset, the config variant and the output directory; the test suite runs this
# notebook on CPU with a tiny local checkpoint and the project's sample problems.

# %%
import os
import subprocess
import sys

REPO_URL = os.environ.get("JAXRL_REPO_URL", "")
if "google.colab" in sys.modules and REPO_URL:
  accelerator = "tpu" if "COLAB_TPU_ADDR" in os.environ else "cuda"
  subprocess.run(["git", "clone", REPO_URL, "jaxrl"], check=False)
  subprocess.run(
    [sys.executable, "-m", "pip", "install", "-q", "-e", f"jaxrl[hf,{accelerator}]"], check=True
  )
  os.chdir("jaxrl")

# %%
import json  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

from jaxrl.config import load_config  # noqa: E402
from jaxrl.hub import resolve_pretrained  # noqa: E402
from jaxrl.metrics import read_metrics  # noqa: E402
from jaxrl.rl import job  # noqa: E402

print(jax.devices())

# %% [markdown]
# ## Model and data
# A Hub id is downloaded once into the Hugging Face cache (weights, config and tokenizer files
# only). GSM8K comes as Parquet shards (`main/train-*.parquet`, `main/test-*.parquet`): the
# math task reads the directory, trains on the train files and evaluates on the test files.

# %%
MODEL = os.environ.get("GRPO_MODEL", "Qwen/Qwen3-0.6B")
DATA = os.environ.get("GRPO_DATA", "")
if not DATA:
  from huggingface_hub import snapshot_download

  gsm8k = snapshot_download("openai/gsm8k", repo_type="dataset", allow_patterns=["main/*"])
  DATA = os.path.join(gsm8k, "main")
model_dir = resolve_pretrained(MODEL)
print("model:", model_dir)
print("data:", DATA)

# %% [markdown]
# ## The config
# `configs/grpo_hf.py:qwen3-0.6b`: 32 prompts x 8 responses per step, up to 1,024 new tokens,
# bf16 rollout from fp32 master weights, KL off, clip-higher, held-out pass@1 (greedy) every
# 10 steps. Any field can be changed here before the run.

# %%
REPO = (
  os.path.abspath(os.path.join(os.getcwd(), ".."))
  if os.path.basename(os.getcwd()) == "notebooks"
  else os.getcwd()
)
variant = os.environ.get("GRPO_VARIANT", "qwen3-0.6b")
cfg = load_config(
  os.path.join(REPO, "configs", "grpo_hf.py"),
  variant,
  {"pretrained.path": model_dir, "task.path": DATA},
)
print(cfg.model)
print(cfg.rollout.prompts_per_step, "prompts x", cfg.rollout.group_size, "responses per step")

# %% [markdown]
# ## Run it
# A progress bar shows the steps; metrics go to `metrics.jsonl` and TensorBoard in the workdir,
# the policy to `<workdir>/hf/`.

# %%
workdir = os.environ.get("GRPO_WORKDIR") or tempfile.mkdtemp(prefix="jaxrl_grpo_gsm8k_")
summary = job.run(cfg, workdir)
print(json.dumps(summary, indent=2))

# %% [markdown]
# ## Reward and held-out accuracy

# %%
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
train = [r for r in records if r["kind"] == "train"]
evals = [r for r in records if r["kind"] == "eval"]
print("held-out pass@1 by step:", [(r["step"], round(r["eval_pass_at_1"], 3)) for r in evals])
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot([r["step"] for r in train], [r["reward_mean"] for r in train])
left.set(title="training reward", xlabel="step", ylabel="mean reward")
right.plot([r["step"] for r in evals], [r["eval_pass_at_1"] for r in evals], marker="o")
right.set(title="held-out pass@1 (greedy)", xlabel="step", ylabel="accuracy")
fig.tight_layout()
plot_path = os.path.join(workdir, "grpo_gsm8k.png")
fig.savefig(plot_path)
print("plots:", plot_path)

# %% [markdown]
# ## The trained policy in transformers
# `<workdir>/hf/final` holds config.json, safetensors and the tokenizer files:
# `AutoModelForCausalLM.from_pretrained` and vLLM open it as it is.

# %%
final = os.path.join(workdir, "hf", "final")
print(sorted(os.listdir(final)))
