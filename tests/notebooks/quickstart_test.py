"""The quick-start notebook runs as a script (smoke variant), and its .ipynb copy is in sync."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.py")


@pytest.mark.notebook
@pytest.mark.slow  # 77 s of a full run; launch_test runs the main job as shipped by default
def test_quickstart_runs(tmp_path):
  env = dict(
    os.environ, QUICKSTART_VARIANT="test", QUICKSTART_WORKDIR=str(tmp_path), JAX_PLATFORMS="cpu"
  )
  result = subprocess.run(
    [sys.executable, NOTEBOOK], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "eval reward by step" in result.stdout
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


@pytest.mark.notebook
def test_ipynb_copy_matches_the_script():
  jupytext = pytest.importorskip("jupytext")
  script = jupytext.read(NOTEBOOK)
  ipynb = jupytext.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"))
  code = lambda nb: [c.source for c in nb.cells]  # noqa: E731
  assert code(script) == code(ipynb), (
    "notebooks/quickstart.ipynb is stale: run "
    "`jupytext --to ipynb notebooks/quickstart.py -o notebooks/quickstart.ipynb`."
  )
