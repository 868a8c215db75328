"""Config files build and convert; bad keys and values are reported by their full path."""

import glob
import importlib.util
import os

import ml_collections
import pytest

from jaxrl.config import ConfigError, ExperimentConfig, default_config, from_config_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))


def load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def variants(module):
  return getattr(module, "VARIANTS", (None,))


def test_there_are_config_files():
  assert CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_file_builds(path):
  module = load(path)
  for arg in variants(module):
    cfg = from_config_dict(module.get_config(arg))
    assert isinstance(cfg, ExperimentConfig)


def test_grpo_tiny_variants_are_listed():
  module = load(os.path.join(REPO, "configs", "grpo_tiny.py"))
  assert {"colocated", "test"} <= set(variants(module))


def test_unknown_key_names_its_path():
  cd = default_config()
  cd.train.optimizer.lerning_rate = 1e-3
  with pytest.raises(ConfigError, match=r"config\.train\.optimizer\.lerning_rate: unknown key"):
    from_config_dict(cd)


def test_wrong_type_names_its_path():
  cd = default_config().to_dict()
  cd["rollout"]["group_size"] = "eight"
  with pytest.raises(ConfigError, match=r"config\.rollout\.group_size: expected int"):
    from_config_dict(cd)
  cd = default_config().to_dict()
  cd["resume"] = 1
  with pytest.raises(ConfigError, match=r"config\.resume: expected bool"):
    from_config_dict(cd)


def test_invalid_value_names_its_section():
  cd = default_config()
  cd.train.loss.aggregation = "sum"
  with pytest.raises(ConfigError, match=r"config\.train\.loss"):
    from_config_dict(cd)


def test_locked_config_rejects_unknown_override():
  cd = default_config()
  cd.lock()
  with pytest.raises(AttributeError):
    cd.train.stepz = 3


def test_defaults_round_trip():
  cfg = from_config_dict(default_config())
  assert cfg == ExperimentConfig()
  assert isinstance(default_config(), ml_collections.ConfigDict)
