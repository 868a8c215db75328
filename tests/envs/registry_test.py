"""Environments by name: shipped ones, a user's `package.module:ClassName`, and clear errors."""

import textwrap

import pytest

from jaxrl.envs import (
  ENVIRONMENTS,
  DelayedGuessNumberEnv,
  EnvConfig,
  EnvError,
  EpisodeLimits,
  GuessNumberEnv,
  PythonToolEnv,
  env_factory,
  environment_class,
)

USER_MODULE = """
from jaxrl.envs import Environment, Step


class Echo(Environment):
  def __init__(self, *, suffix="!"):
    self.suffix = suffix

  def reset(self, record):
    return [{"role": "user", "content": record["text"]}]

  def step(self, action):
    return Step([], float(action.endswith(self.suffix)), True)


class Half(Environment):
  def reset(self, record):
    return []


def not_a_class():
  pass


class NotAnEnv:
  def reset(self, record):
    return []

  def step(self, action):
    return None
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  package = tmp_path / "my_envs_pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "games.py").write_text(textwrap.dedent(USER_MODULE))
  (package / "broken.py").write_text("import a_dependency_that_is_not_installed\n")
  (package / "raises.py").write_text("raise RuntimeError('configuration missing')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  return "my_envs_pkg"


def test_shipped_environments_resolve_by_name():
  assert {
    "guess_number": GuessNumberEnv,
    "guess_number_delayed": DelayedGuessNumberEnv,
    "python_tool": PythonToolEnv,
  } == ENVIRONMENTS
  make = env_factory("guess_number", {"max_guesses": 4})
  a, b = make(), make()
  assert isinstance(a, GuessNumberEnv) and a is not b and a.max_guesses == 4


def test_a_users_class_is_loaded_with_its_kwargs(user_module):
  make = env_factory(f"{user_module}.games:Echo", {"suffix": "?"})
  env = make()
  assert env.reset({"text": "hi"}) == [{"role": "user", "content": "hi"}]
  assert env.step("why?").reward == 1.0
  cfg = EnvConfig(name=f"{user_module}.games:Echo", limits=EpisodeLimits(max_turns=2))
  assert cfg.limits.max_turns == 2 and EnvConfig().name == ""


@pytest.mark.parametrize(
  "name, message",
  [
    ("guess", r"unknown environment 'guess': the shipped environments are \['guess_number', "),
    ("", "must be a non-empty str"),
    ("a:b:c", "is not of the form 'package.module:ClassName'"),
    (":Echo", "is not of the form"),
    ("{pkg}.games:", "is not of the form"),
    ("no_such_pkg_xyz.envs:Env", "no module named 'no_such_pkg_xyz' \\(is its package installed"),
    ("{pkg}.nope:Env", "no module named '{pkg}.nope'"),
    (
      "{pkg}.broken:Env",
      "importing '{pkg}.broken' failed: No module named 'a_dependency_that_is_not",
    ),
    ("{pkg}.raises:Env", "importing '{pkg}.raises' raised RuntimeError: configuration missing"),
    (
      "{pkg}.games:Missing",
      "has no 'Missing'; the environments it defines are \\['Echo', 'Half'\\]",
    ),
    (
      "{pkg}.games:not_a_class",
      "is a function, not a class: name a subclass of jaxrl.envs.Environment",
    ),
    ("{pkg}.games:NotAnEnv", "class NotAnEnv is not a subclass of jaxrl.envs.Environment"),
    ("{pkg}.games:Half", "does not define \\['step'\\]"),
  ],
)
def test_bad_names_are_clear_errors(user_module, name, message):
  with pytest.raises(EnvError, match=message.format(pkg=user_module)):
    environment_class(name.format(pkg=user_module))


def test_constructor_arguments_are_checked_up_front(user_module):
  with pytest.raises(EnvError, match=r"'guess_number' does not take the arguments \['guesses'\]"):
    env_factory("guess_number", {"guesses": 3})
  with pytest.raises(EnvError, match=r"its constructor takes \['suffix'\]"):
    EnvConfig(name=f"{user_module}.games:Echo", kwargs={"prefix": "x"})
  with pytest.raises(EnvError, match="'python_tool' with .*answer_check 'exact' is not one of"):
    env_factory("python_tool", {"answer_check": "exact"})()
