"""Token ids of multi-turn trajectories: appending each turn's continuation to the sampled ids
gives, id for id, what the chat template renders for the whole conversation."""

import json

import pytest
from helpers import hf_tokenizers

from jaxrl.data import ByteTokenizer, CharTokenizer, load_tokenizer
from jaxrl.envs import (
  EnvError,
  PythonToolEnv,
  check_tools_render,
  continuation_ids,
  end_of_turn_id,
  guess_number,
  prompt_ids,
)

DATE = {"date_string": "26 Jul 2024"}  # the llama3 template reads today's date without it


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  return load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("q"), "qwen3"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
  return load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("l"), "llama3"))


def call(code):
  return (
    f'<tool_call>\n{{"name": "python", "arguments": {json.dumps({"code": code})}}}\n</tool_call>'
  )


def test_qwen3_tool_trajectory_matches_the_full_render_id_for_id(qwen3):
  env = PythonToolEnv()
  tools = env.tools
  first = env.reset({"question": "What is 17 * 23?", "answer": "391"})
  im_end = qwen3.token_to_id("<|im_end|>")
  turns = [call("print(17 * 23)"), call("print(391 / 17)"), "So it is \\boxed{391}."]
  env_messages = [
    [{"role": "tool", "content": "391"}],
    [{"role": "tool", "content": "23.0"}, {"role": "user", "content": "Sure?"}],
  ]
  ids = prompt_ids(qwen3, first, tools)
  mask = [0] * len(ids)
  chat = list(first)
  all_sampled = []
  for i, turn in enumerate(turns):
    sampled = [*qwen3.encode(turn), im_end]  # the policy's turn, ending at its stop token
    all_sampled += sampled
    ids += sampled
    mask += [1] * len(sampled)
    chat.append({"role": "assistant", "content": turn})
    if i < len(env_messages):
      glue = continuation_ids(qwen3, env_messages[i], stop_id=im_end, tools=tools)
      ids += glue
      mask += [0] * len(glue)
      chat += env_messages[i]
  full = qwen3.apply_chat_template(chat, False, tools=tools)
  assert full[: len(ids)] == ids and qwen3.decode(full[len(ids) :]).strip() == ""
  # The mask picks out exactly the sampled ids, and the glue holds no stop token twice.
  assert [t for t, m in zip(ids, mask, strict=True) if m] == all_sampled
  assert ids.count(im_end) == full.count(im_end)
  assert qwen3.render_chat_template(first, tools=tools).count('"name": "python"') == 1


def test_llama3_feedback_trajectory_matches_the_full_render(llama3):
  eot = llama3.token_to_id("<|eot_id|>")
  first = [{"role": "user", "content": guess_number.prompt_text(3, 17)}]
  turns, feedback = ["10", "14", "12"], ["higher", "lower"]
  ids = prompt_ids(llama3, first, (), DATE)
  chat = list(first)
  for i, turn in enumerate(turns):
    ids += [*llama3.encode(turn), eot]
    chat.append({"role": "assistant", "content": turn})
    if i < len(feedback):
      message = [{"role": "user", "content": feedback[i]}]
      ids += continuation_ids(llama3, message, stop_id=eot, template_kwargs=DATE)
      chat += message
  assert llama3.apply_chat_template(chat, False, **DATE) == ids


def test_a_turn_cut_off_before_its_stop_token_gets_the_end_of_turn_as_glue(qwen3):
  im_end = qwen3.token_to_id("<|im_end|>")
  glue = continuation_ids(qwen3, [{"role": "user", "content": "go on"}], stop_id=None)
  assert glue[0] == im_end
  assert continuation_ids(qwen3, [{"role": "user", "content": "go on"}], stop_id=im_end) == glue[1:]


def test_a_supervised_turn_ends_with_the_templates_end_of_turn(qwen3, llama3):
  # Qwen's EOS is <|endoftext|>, but the template ends an assistant turn with <|im_end|>.
  im_end, eot = qwen3.token_to_id("<|im_end|>"), llama3.token_to_id("<|eot_id|>")
  assert end_of_turn_id(qwen3) == im_end != qwen3.eos_id
  assert end_of_turn_id(qwen3, PythonToolEnv().tools) == im_end
  assert end_of_turn_id(llama3, (), DATE) == eot == llama3.eos_id
  assert end_of_turn_id(ByteTokenizer()) == ByteTokenizer().eos_id
  chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
  prompt = qwen3.apply_chat_template(chat[:1])
  assert qwen3.apply_chat_template(chat, False)[: len(prompt) + 2] == [
    *prompt,
    *qwen3.encode("4"),
    end_of_turn_id(qwen3),
  ]


def test_plain_tokenizers_get_the_contents_as_text():
  byte = ByteTokenizer()
  messages = [{"role": "user", "content": "guess a number from 1 to 7:"}]
  assert prompt_ids(byte, messages) == [byte.bos_id, *byte.encode("guess a number from 1 to 7: ")]
  assert continuation_ids(byte, [{"role": "user", "content": "higher"}], stop_id=byte.eos_id) == (
    byte.encode("higher ")
  )
  with pytest.raises(EnvError, match=r"no chat template to describe the tools \['python'\]"):
    prompt_ids(byte, messages, PythonToolEnv().tools)


def test_guess_number_speaks_the_char_tokenizers_alphabet():
  char = CharTokenizer()
  env = guess_number.GuessNumberEnv(max_guesses=6)
  for record in guess_number.records("test", 20) + guess_number.records("train", 50, seed=3):
    char.encode(record["prompt"])
    env.reset(record)
    for guess in (record["low"] - 1, record["low"], record["high"]):
      for message in env.step(f"{guess}").messages:
        char.encode(message["content"])
      env.reset(record)
    for message in env.step("no idea").messages:
      char.encode(message["content"])


def test_check_tools_render_accepts_templates_that_show_the_tools(qwen3, llama3):
  check_tools_render(qwen3, PythonToolEnv().tools)
  check_tools_render(llama3, PythonToolEnv().tools, DATE)
  check_tools_render(ByteTokenizer(), [])  # no tools, nothing to render


def test_check_tools_render_names_a_tool_the_template_drops(tmp_path):
  directory = hf_tokenizers.write_tokenizer(tmp_path, "qwen3")
  config_path = f"{directory}/tokenizer_config.json"
  with open(config_path) as f:
    config = json.load(f)
  config["chat_template"] = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
  with open(config_path, "w") as f:
    json.dump(config, f)
  with pytest.raises(EnvError, match="tool 'python': the chat template renders the prompt without"):
    check_tools_render(load_tokenizer(directory), PythonToolEnv().tools)


def test_check_tools_render_names_a_malformed_schema(qwen3):
  bad = [{"type": "function", "function": {"name": "run it", "parameters": {"type": "object"}}}]
  with pytest.raises(EnvError, match="tool 'run it': \"function.name\" must be"):
    check_tools_render(qwen3, bad)
