"""The GSM8K notebook runs as a script on CPU (tiny local checkpoint, the sample problems), and
its .ipynb copy is in sync."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from helpers import hf_checkpoints  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "notebooks", "grpo_gsm8k.py")
SAMPLE = os.path.join(REPO, "jaxrl", "data", "samples", "math_sample.jsonl")


@pytest.mark.notebook
@pytest.mark.slow  # 71 s in a loaded full run; the quickstart notebook runs by default
def test_grpo_gsm8k_runs(tmp_path):
  checkpoint = hf_checkpoints.write_checkpoint(
    tmp_path / "ckpt", "qwen3", tied=True, tokenizer="qwen3"
  )
  env = dict(
    os.environ,
    GRPO_MODEL=checkpoint,
    GRPO_DATA=SAMPLE,
    GRPO_VARIANT="test",
    GRPO_WORKDIR=str(tmp_path / "run"),
    JAX_PLATFORMS="cpu",
  )
  result = subprocess.run(
    [sys.executable, NOTEBOOK], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "held-out pass@1 by step" in result.stdout
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
  assert (tmp_path / "run" / "grpo_gsm8k.png").stat().st_size > 0
  assert (tmp_path / "run" / "hf" / "final" / "model.safetensors").exists()


@pytest.mark.notebook
def test_ipynb_copy_matches_the_script():
  jupytext = pytest.importorskip("jupytext")
  script = jupytext.read(NOTEBOOK)
  ipynb = jupytext.read(os.path.join(REPO, "notebooks", "grpo_gsm8k.ipynb"))
  code = lambda nb: [c.source for c in nb.cells]  # noqa: E731
  assert code(script) == code(ipynb), (
    "notebooks/grpo_gsm8k.ipynb is stale: run "
    "`jupytext --to ipynb notebooks/grpo_gsm8k.py -o notebooks/grpo_gsm8k.ipynb`."
  )
