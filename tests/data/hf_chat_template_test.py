"""Tests of `HFTokenizer`'s chat templates: the same text and ids as transformers'
`apply_chat_template` (fixtures: tests/data/conftest.py; conversations:
tests/helpers/hf_tokenizer_cases.py). They skip without transformers (it is in the dev extra)."""

import copy
import os

import numpy as np
import pytest
from helpers import hf_tokenizers
from helpers.hf_tokenizer_cases import (
  CONVERSATIONS,
  DATE,
  GENERATION_KWARGS,
  TOOL_CONVERSATION,
  TOOLS,
  their_ids,
  their_text,
  variant,
)

from jaxrl.data.hf_tokenizer import TokenizerError, load_tokenizer


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, style, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  for kwargs in GENERATION_KWARGS:
    kwargs = {**kwargs, **(DATE if style == "llama3" else {})}
    text = ours.render_chat_template(copy.deepcopy(messages), add_generation_prompt, **kwargs)
    assert text == their_text(theirs, messages, add_generation_prompt, **kwargs)
    ids = ours.apply_chat_template(copy.deepcopy(messages), add_generation_prompt, **kwargs)
    assert ids == their_ids(theirs, messages, add_generation_prompt, **kwargs)
    assert ours.encode(text) == ids


def test_chat_template_with_tools_matches_transformers(ours, theirs, style):
  kwargs = DATE if style == "llama3" else {}
  conversations = [CONVERSATIONS["system"], CONVERSATIONS["one_user"]]
  if style == "qwen3":
    conversations.append(TOOL_CONVERSATION)
  for messages in conversations:
    text = ours.render_chat_template(messages, tools=TOOLS, **kwargs)
    assert text == their_text(theirs, messages, True, tools=TOOLS, **kwargs)
    assert "«2+2»" in text and "<expr> & returns" in text  # tojson keeps unicode, no HTML escapes
    assert ours.apply_chat_template(messages, tools=TOOLS, **kwargs) == their_ids(
      theirs, messages, True, tools=TOOLS, **kwargs
    )


def test_chat_template_reads_today_like_transformers(llama3_dir, auto_tokenizer):
  messages = CONVERSATIONS["one_user"]
  text = load_tokenizer(llama3_dir).render_chat_template(messages)
  assert text == their_text(auto_tokenizer.from_pretrained(llama3_dir), messages, True)
  assert "Today Date: " in text and "date_string" not in text


def test_qwen3_template_thinking(qwen3):
  ours = qwen3
  text = ours.render_chat_template(CONVERSATIONS["reasoning_in_content"], False)
  assert "early thought" not in text  # reasoning before the last user message is dropped
  assert "<|im_start|>assistant\n4<|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n<think>\nlate thought\n</think>\n\n6<|im_end|>\n")
  prompt = CONVERSATIONS["one_user"]
  assert ours.render_chat_template(prompt).endswith(
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"
  )
  no_thinking = ours.render_chat_template(prompt, enable_thinking=False)
  assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert not ours.render_chat_template(prompt).startswith("<|im_start|>system")
  ids = ours.apply_chat_template(prompt)
  assert ids[0] == ours.token_to_id("<|im_start|>") and ours.bos_id is None


def test_llama3_template_writes_one_bos(llama3_dir):
  ours = load_tokenizer(llama3_dir)
  ids = ours.apply_chat_template(CONVERSATIONS["multi_turn"], **DATE)
  assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1
  header = ours.encode("<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert ids[-len(header) :] == header
  assert ours.decode(ids).startswith("system\n\nCutting Knowledge Date")


ENV_TEMPLATE = """\
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {%- if ns.n > 3 %}{% break %}{% endif %}
[{{ m.role }}|{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}]
  {{ m | tojson(ensure_ascii=true) }} {{ m | tojson(separators=(',', ':')) }}
  {{ dict(a=1, b=m.role) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}
    {% generation %}{{ m.content | upper }}{% endgeneration %}

{% endfor %}
{{- bos_token }}|{{ eos_token }}|{{ pad_token | default('no pad') }}|{{ unk_token is defined }}
{{- '|' ~ custom | default('none') ~ '|' ~ (tools | length if tools else 'no tools') }}
{{- '|' ~ strftime_now('%Y') ~ '|' ~ add_generation_prompt }}
"""


def test_template_environment_matches_transformers(tmp_path, auto_tokenizer):
  """Loop controls, namespace, dict, tojson's options, the generation tag, special-token
  variables, None keys dropped, reasoning aliases and numpy values: as transformers renders."""
  directory = variant(tmp_path, "llama3", files={"chat_template.jinja": ENV_TEMPLATE})
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = [
    {"role": "system", "content": "Be «brief» & <exact>", "name": None},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "Ünï\n", "score": np.float32(0.5), "n": np.int64(3)},
    {"role": "assistant", "content": "4", "reasoning": "two and two", "tags": ("a", "b")},
    {"role": "user", "content": "after the break"},
  ]
  for kwargs in ({}, {"custom": "set", "tools": TOOLS}, {"add_generation_prompt": False}):
    kwargs = {"add_generation_prompt": True, **kwargs}
    agp = kwargs.pop("add_generation_prompt")
    text = ours.render_chat_template(copy.deepcopy(messages), agp, **kwargs)
    assert text == their_text(theirs, messages, agp, **kwargs)
    assert "after the break" not in text and "never shown" not in text
    assert '"reasoning_content": "two and two"' in text and '"name"' not in text
  assert "<|begin_of_text|>|<|eot_id|>|no pad|False|" in text


def _marked(template, marker):
  return template.replace("<|im_start|>assistant\n{% if", f"{marker}<|im_start|>assistant\n{{% if")


def test_named_templates_in_config(tmp_path, auto_tokenizer):
  template = hf_tokenizers.QWEN3_TEMPLATE
  named = [
    {"name": "default", "template": _marked(template, "[default]")},
    {"name": "tool_use", "template": _marked(template, "[tool_use]")},
  ]
  directory = variant(tmp_path, "qwen3", lambda c: c.update(chat_template=named))
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = CONVERSATIONS["system"]
  for tools in (None, TOOLS, []):
    text = ours.render_chat_template(messages, tools=tools)
    assert text == their_text(theirs, messages, True, tools=tools)
    assert ("[tool_use]" if tools is not None else "[default]") in text
  assert set(ours.chat_templates) == {"default", "tool_use"}


def test_template_files_replace_the_config_template(tmp_path, auto_tokenizer):
  template = hf_tokenizers.QWEN3_TEMPLATE
  files = {
    "chat_template.jinja": _marked(template, "[file]"),
    "additional_chat_templates/tool_use.jinja": _marked(template, "[extra file]"),
  }
  directory = variant(tmp_path, "qwen3", files=files)
  ours, theirs = load_tokenizer(directory), auto_tokenizer.from_pretrained(directory)
  messages = CONVERSATIONS["one_user"]
  for tools in (None, TOOLS):
    text = ours.render_chat_template(messages, tools=tools)
    assert text == their_text(theirs, messages, True, tools=tools)
    assert ("[extra file]" if tools else "[file]") in text


def test_template_errors_name_their_source(tmp_path, auto_tokenizer):
  """A template that raises fails here as in transformers, and says which file it came from."""
  import jinja2

  qwen = hf_tokenizers.write_tokenizer(tmp_path / "qwen3", "qwen3")
  llama = hf_tokenizers.write_tokenizer(tmp_path / "llama3", "llama3")
  late_system = CONVERSATIONS["one_user"] + [{"role": "system", "content": "late"}]
  cases = [
    (qwen, late_system, "A system message may only come first", "key 'chat_template'"),
    (qwen, [{"role": "robot", "content": "beep"}], "Unknown role: robot", "key 'chat_template'"),
    (llama, TOOL_CONVERSATION, "Unknown role: tool", "chat_template.jinja"),
  ]
  for directory, messages, message, where in cases:
    with pytest.raises(TokenizerError, match=message) as e:
      load_tokenizer(directory).apply_chat_template(messages)
    assert os.path.join(directory, "") in str(e.value) and where in str(e.value)
    with pytest.raises(jinja2.TemplateError, match=message):
      auto_tokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False)

  sandbox = "{% set ns = namespace(n=0) %}{% set ns._secret = 1 %}{{ ns.n }}"
  directory = variant(tmp_path, "qwen3", lambda c: c.update(chat_template=sandbox))
  with pytest.raises(TokenizerError, match="SecurityError"):
    load_tokenizer(directory).render_chat_template(CONVERSATIONS["one_user"])


def test_chat_inputs_errors(tmp_path, qwen3):
  tok = qwen3
  with pytest.raises(TokenizerError, match="empty list of messages"):
    tok.apply_chat_template([])
  with pytest.raises(TypeError, match="chat messages and tools must be dicts, got .hello."):
    tok.apply_chat_template(["hello"])
  with pytest.raises(TypeError, match="get_json_schema"):
    tok.apply_chat_template(CONVERSATIONS["one_user"], tools=[len])

  directory = variant(tmp_path, "qwen3", lambda c: c.pop("chat_template"))
  base = load_tokenizer(directory)
  assert base.chat_templates == {}
  with pytest.raises(TokenizerError, match="no chat template") as e:
    base.apply_chat_template(CONVERSATIONS["one_user"])
  assert directory in str(e.value)
  named = [{"name": "tool_use", "template": "{{ messages }}"}]
  directory = variant(tmp_path / "n", "qwen3", lambda c: c.update(chat_template=named))
  with pytest.raises(TokenizerError, match=r"none of \['tool_use'\] is 'default'"):
    load_tokenizer(directory).apply_chat_template(CONVERSATIONS["one_user"])
