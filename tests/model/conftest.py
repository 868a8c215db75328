"""Fixtures of the Hugging Face checkpoint tests (`hf_test.py`, `hf_errors_test.py`)."""

import json
import pathlib

import pytest
from helpers import hf_checkpoints as hc


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """Writes each checkpoint once per module: `checkpoints(arch, tied, **overrides)`."""
  made = {}

  def get(arch, tied=False, **overrides):
    key = (arch, tied, json.dumps(overrides, sort_keys=True))
    if key not in made:
      directory = tmp_path_factory.mktemp(arch)
      made[key] = pathlib.Path(hc.write_checkpoint(directory, arch, tied=tied, **overrides))
    return made[key]

  return get
