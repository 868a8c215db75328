"""Conversations, tools and tokenizer-directory edits shared by the tests that compare
`jaxrl.data.hf_tokenizer` with transformers (tests/data/hf_tokenizer_test.py and
hf_chat_template_test.py)."""

import copy
import json
import os

from helpers import hf_tokenizers

DATE = {"date_string": "26 Jul 2024"}  # the llama3 template reads today's date without it

CONVERSATIONS = {
  "one_user": [{"role": "user", "content": "What is 17 * 23?"}],
  "system": [
    {"role": "system", "content": "Reason step by step; put the answer in \\boxed{}."},
    {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May."},
  ],
  "multi_turn": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "  Ünïcödé 🙂 <b>&amp;</b>\n\nsum 1..100?  "},
  ],
  "reasoning_in_content": [
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "<think>\nearly thought\n</think>\n\n4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nlate thought\n</think>\n\n6"},
  ],
  "reasoning_fields": [
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    {"role": "user", "content": "3 + 3?"},
    {"role": "assistant", "content": "6", "thinking": "an alias", "name": None},
  ],
}
GENERATION_KWARGS = ({}, {"enable_thinking": False}, {"enable_thinking": True})
TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "calculator",
      "description": "Evaluates <expr> & returns a number, e.g. «2+2».",
      "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
  }
]
TOOL_CONVERSATION = [
  {"role": "user", "content": "Use the tool: 2 + 2"},
  {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "calculator", "arguments": {"expr": "2 + 2 ≠ <5>"}}}],
  },
  {"role": "tool", "content": "4"},
]


def variant(tmp_path, style, edit_config=None, files=None):
  """A tokenizer directory of `style` with its tokenizer_config.json edited and files added."""
  directory = hf_tokenizers.write_tokenizer(tmp_path / style, style)
  path = os.path.join(directory, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  if edit_config is not None:
    edit_config(config)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(config, f)
  for name, text in (files or {}).items():
    os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
      f.write(text)
  return directory


def their_ids(theirs, messages, add_generation_prompt, **kwargs):
  kwargs |= {"add_generation_prompt": add_generation_prompt, "tokenize": True, "return_dict": False}
  return theirs.apply_chat_template(copy.deepcopy(messages), **kwargs)


def their_text(theirs, messages, add_generation_prompt, **kwargs):
  kwargs |= {"add_generation_prompt": add_generation_prompt, "tokenize": False}
  return theirs.apply_chat_template(copy.deepcopy(messages), **kwargs)
