"""Multi-turn test parts: a scripted stand-in for `PagedEngine` (the calls `MultiTurnRollout`
makes: submit, step, has_work, drop_kept, model.config.max_seq_len), each turn's text given by
a policy, so that trajectories have exact, chosen lengths; and a guessing game whose messages
the char tokenizer cannot render (env name "helpers.scripted_multi_turn:UnrenderableGuessEnv")."""

import time
import types

from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs import GuessNumberEnv, Step


class ScriptedEngine:
  """`policy(request_id, turn, prompt_ids) -> text`; each turn is that text's ids and EOS, cut
  to the request's `max_new_tokens` ("stop" when the EOS fits, else "length")."""

  def __init__(self, policy, tokenizer: CharTokenizer, max_seq_len: int = 256):
    self.policy, self.tokenizer = policy, tokenizer
    self.model = types.SimpleNamespace(config=types.SimpleNamespace(max_seq_len=max_seq_len))
    self.queue, self.turns = [], {}

  @property
  def has_work(self) -> bool:
    return bool(self.queue)

  def submit(self, record) -> None:
    self.queue.append(record)

  def drop_kept(self, request_id: str) -> bool:
    return False

  def step(self) -> list:
    for r in self.queue:
      turn = self.turns[r.request_id] = self.turns.get(r.request_id, -1) + 1
      text = self.policy(r.request_id, turn, r.prompt_ids)
      ids = [*self.tokenizer.encode(text), self.tokenizer.eos_id][: r.sampling.max_new_tokens]
      r.token_ids, r.logprobs, r.versions = ids, [-0.5] * len(ids), [0] * len(ids)
      r.finish_reason = "stop" if ids[-1] == self.tokenizer.eos_id else "length"
    done, self.queue = self.queue, []
    return done


class UnrenderableGuessEnv(GuessNumberEnv):
  """Answers in characters the char tokenizer lacks (on target 5), or opens with one (6)."""

  def reset(self, record):
    messages = super().reset(record)
    if self._target == 6:
      messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " \u00e9"}
    return messages

  def step(self, action):
    step = super().step(action)
    if self._target == 5 and not step.done:
      return Step([{"role": "user", "content": "Higher \u00e9"}], 0.0, False, step.info)
    return step


class SlowShapedGuessEnv(GuessNumberEnv):
  """A slow plain step (a tool that takes time) with a reward of 0.1 for each step that goes on
  (env name "helpers.scripted_multi_turn:SlowShapedGuessEnv")."""

  def step(self, action):
    time.sleep(0.3)
    step = super().step(action)
    return step if step.done else Step(step.messages, 0.1, False, step.info)
