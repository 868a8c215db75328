"""Token ids of a multi-turn trajectory: the first prompt, and what follows each model turn.

Token in, token out: the engine never re-tokenises a conversation. It starts a trajectory from
`prompt_ids(...)`, appends the ids the policy sampled (its turn, up to and including the stop
token), then `continuation_ids(...)` for the environment's messages (template glue, the messages,
and the header of the next assistant turn), and samples again. Only sampled ids are trained on;
everything `prompt_ids` and `continuation_ids` give is masked out of the loss.

The continuation is what the chat template writes after an assistant turn's content when the
environment's messages follow it: rendered once with a placeholder assistant turn and cut at its
content, so that templates that render earlier turns differently once later ones exist (Qwen3
drops old reasoning) cannot shift the ids already sampled. Its first id is usually the end-of-
turn token the policy has just sampled; `stop_id` drops it, so it is not there twice.

Tokenizers without a chat template (the project's char and byte tokenizers) get plain text:
BOS, then each message's content followed by a space, and the same for the continuation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.data.prompts import has_chat_template
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs.base import EnvError
from jaxrl.envs.tools import check_tool_schema

# Private-use characters: no template or tokenizer gives them a meaning.
_TURN = "\ue000jaxrl-turn\ue001"
_PROBE_QUESTION = "\ue000jaxrl-question\ue001"


def plain_text(messages: Sequence[Mapping[str, Any]]) -> str:
  """Messages as plain text, for tokenizers without a chat template."""
  return "".join(f"{m['content']} " for m in messages)


def prompt_ids(
  tokenizer: Tokenizer,
  messages: Sequence[Mapping[str, Any]],
  tools: Sequence[Mapping[str, Any]] = (),
  template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
  """The ids of a trajectory's first prompt, ending with the header of the model's turn.

  Args:
    tokenizer: any `Tokenizer`.
    messages: `Episode.reset`'s messages.
    tools: the environment's tool schemas (`Environment.tools`), rendered by the template.
    template_kwargs: template variables, e.g. {"enable_thinking": False}.

  Raises:
    EnvError: tools with a tokenizer that has no chat template.
  """
  if has_chat_template(tokenizer):
    kwargs = dict(template_kwargs or {})
    return tokenizer.apply_chat_template(list(messages), True, tools=list(tools) or None, **kwargs)
  if tools:
    raise EnvError(_no_template_for_tools(tools))
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  return [*bos, *tokenizer.encode(plain_text(messages))]


def continuation_text(
  tokenizer: Tokenizer,
  messages: Sequence[Mapping[str, Any]],
  tools: Sequence[Mapping[str, Any]] = (),
  template_kwargs: Mapping[str, Any] | None = None,
) -> str:
  """What the chat template writes after an assistant turn's content when `messages` follow,
  through the header of the next assistant turn.

  Raises:
    EnvError: the template does not write an assistant turn's content as it is.
  """
  kwargs = dict(template_kwargs or {})
  chat = [
    {"role": "user", "content": _PROBE_QUESTION},
    {"role": "assistant", "content": _TURN},
    *messages,
  ]
  text = tokenizer.render_chat_template(chat, True, tools=list(tools) or None, **kwargs)
  if text.count(_TURN) != 1:
    raise EnvError(
      "the chat template does not write an assistant turn's content as it is, so the ids after "
      "a model turn cannot be rendered without re-tokenising it."
    )
  return text[text.index(_TURN) + len(_TURN) :]


def end_of_turn_id(
  tokenizer: Tokenizer,
  tools: Sequence[Mapping[str, Any]] = (),
  template_kwargs: Mapping[str, Any] | None = None,
) -> int:
  """The stop id that ends a model turn where the chat template ends it: the first id the
  template writes after an assistant turn's content when it is a stop id (Qwen's <|im_end|>,
  Llama 3's <|eot_id|>), else `eos_id` (tokenizers without a chat template too).

  A supervised turn ends with it, as the original would end it; `eos_id` alone is not it where a
  base tokenizer's EOS (Qwen's <|endoftext|>) differs from the chat model's end of turn.
  """
  if has_chat_template(tokenizer):
    probe = [{"role": "user", "content": _PROBE_QUESTION}]
    ids = tokenizer.encode(continuation_text(tokenizer, probe, tools, template_kwargs))
    if ids and ids[0] in tokenizer.stop_ids:
      return ids[0]
  return tokenizer.eos_id


def continuation_ids(
  tokenizer: Tokenizer,
  messages: Sequence[Mapping[str, Any]],
  *,
  stop_id: int | None,
  tools: Sequence[Mapping[str, Any]] = (),
  template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
  """The ids to append after a model turn for the environment's `messages`.

  Args:
    tokenizer: any `Tokenizer`.
    messages: the `Step`'s messages.
    stop_id: the last id the policy sampled when it was a stop id (its turn ended there), else
      None (cut off by a length limit): a leading copy of it is dropped.
    tools: the environment's tool schemas (some templates pick a different template with them).
    template_kwargs: template variables, as for `prompt_ids`.
  """
  if not has_chat_template(tokenizer):
    return tokenizer.encode(plain_text(messages))
  ids = tokenizer.encode(continuation_text(tokenizer, messages, tools, template_kwargs))
  if stop_id is not None and ids and ids[0] == stop_id:
    ids = ids[1:]
  return ids


def check_tools_render(
  tokenizer: Tokenizer,
  tools: Sequence[Mapping[str, Any]],
  template_kwargs: Mapping[str, Any] | None = None,
) -> None:
  """Checks that the chat template shows every tool to the model (call it once, at start).

  Raises:
    EnvError: a schema is malformed, the template raised on it, or it renders the prompt without
      a tool's name (the model would never learn of it); names the tool.
  """
  if not tools:
    return
  if not has_chat_template(tokenizer):
    raise EnvError(_no_template_for_tools(tools))
  for schema in tools:
    try:
      check_tool_schema(schema)
    except ValueError as e:
      raise EnvError(str(e)) from None
  chat = [{"role": "user", "content": _PROBE_QUESTION}]
  try:
    text = tokenizer.render_chat_template(
      chat, True, tools=list(tools), **dict(template_kwargs or {})
    )
  except ValueError as e:
    names = [t["function"]["name"] for t in tools]
    raise EnvError(f"the chat template cannot render the tools {names}: {e}") from e
  for schema in tools:
    name = schema["function"]["name"]
    if name not in text:
      raise EnvError(
        f"tool {name!r}: the chat template renders the prompt without it, so the model would not "
        "know it exists; use a model whose template renders `tools` (Qwen3, Llama 3.1+), or "
        "describe the tool in the system prompt and pass no tools."
      )


def _no_template_for_tools(tools: Sequence[Mapping[str, Any]]) -> str:
  names = [t.get("function", {}).get("name") for t in tools]
  return (
    f"the tokenizer has no chat template to describe the tools {names} with: use a Hugging Face "
    "tokenizer whose template renders tools (Qwen3, Llama 3.1+)."
  )
