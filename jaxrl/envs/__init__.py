"""Multi-turn environments and tools: the model acts, the environment answers, for several turns.

An environment (`Environment`) is made per trajectory: `reset(record)` gives the first chat
messages from a dataset record, `step(action)` takes the model's turn (decoded text) and returns
`Step(messages, reward, done, info)`. Either may be `async def`. `Episode` drives one through a
trajectory under `EpisodeLimits` (turns, tool calls, step timeout): a step that fails, hangs or
crashes ends the episode with `info["end_reason"]` and the failure reward, and the trajectory is
kept. Shipped environments (`ENVIRONMENTS`): `python_tool` (math with a sandboxed Python tool)
and `guess_number` (a synthetic game a tiny model can learn on a CPU); a class of your own is
named "package.module:ClassName" (`EnvConfig`, `env_factory`). Tools (`Tool`, `ToolEnvironment`)
are JSON schemas rendered by the chat template, and their calls are parsed from the model's text
(Hermes/Qwen `<tool_call>` or Llama 3 JSON); a malformed call is answered with an error message.

How the RL loop uses this (`config.env`; `jaxrl.rl.episodes` in training, `jaxrl.rl.multi_turn`
in evaluation). Token in, token out: for each trajectory the rollout makes an environment and
an `Episode`, renders `reset`'s messages with `prompt_ids` (the chat template, with the
environment's `tools`), and decodes the policy's turn. At a stop token it decodes that
turn's ids to text, awaits `Episode.step` off the decode loop (the request gives up its decode
slot while it waits), appends `continuation_ids` of the step's messages to the trajectory's
token ids, and decodes again, until the step says `done` or the trajectory runs out of tokens
(`Episode.end("max_tokens")`). The learner then gets exactly the ids that were sampled, with a
loss mask that is 1 on sampled ids and 0 on everything `prompt_ids` and `continuation_ids` gave,
the per-token log-probs and policy versions of every turn, and the episode's reward (the sum of
its turns'), from which GRPO computes advantages over whole trajectories.
"""

from jaxrl.envs.base import (
  EndEpisode,
  EnvError,
  Environment,
  Step,
  StepTimeout,
  check_messages,
  check_step,
  run_reset,
  run_step,
)
from jaxrl.envs.episode import Episode, EpisodeLimits, EpisodeSummary, run_episode
from jaxrl.envs.guess_number import DelayedGuessNumberEnv, GuessNumberEnv
from jaxrl.envs.python_tool import PythonToolEnv
from jaxrl.envs.registry import ENVIRONMENTS, EnvConfig, env_factory, environment_class
from jaxrl.envs.render import (
  check_tools_render,
  continuation_ids,
  continuation_text,
  end_of_turn_id,
  prompt_ids,
)
from jaxrl.envs.sandbox import Isolation, SandboxLimits, SandboxResult, isolation, run_python
from jaxrl.envs.tools import (
  TOOL_CALL_FORMATS,
  MalformedCall,
  ParsedTurn,
  Tool,
  ToolCall,
  ToolEnvironment,
  ToolError,
  check_tool_schema,
  parse_tool_calls,
)

__all__ = [
  "ENVIRONMENTS",
  "TOOL_CALL_FORMATS",
  "DelayedGuessNumberEnv",
  "EndEpisode",
  "EnvConfig",
  "EnvError",
  "Environment",
  "Episode",
  "EpisodeLimits",
  "EpisodeSummary",
  "GuessNumberEnv",
  "Isolation",
  "MalformedCall",
  "ParsedTurn",
  "PythonToolEnv",
  "SandboxLimits",
  "SandboxResult",
  "Step",
  "StepTimeout",
  "Tool",
  "ToolCall",
  "ToolEnvironment",
  "ToolError",
  "check_messages",
  "check_step",
  "check_tool_schema",
  "check_tools_render",
  "continuation_ids",
  "continuation_text",
  "end_of_turn_id",
  "env_factory",
  "environment_class",
  "isolation",
  "parse_tool_calls",
  "prompt_ids",
  "run_episode",
  "run_python",
  "run_reset",
  "run_step",
]
