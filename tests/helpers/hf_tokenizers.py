"""Tiny Hugging Face tokenizer directories, written on the spot for tests (no Hub access).

`write_tokenizer(directory, style)` trains a byte-level BPE on a small in-code corpus of math
word problems and chat text (a few hundred tokens, trained once per process, so every call writes
the same files), adds the style's special tokens after the base vocabulary and writes the files a
Hub checkpoint ships: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json and, for "llama3", chat_template.jinja.

Styles:
  "qwen3": Qwen2's pre-tokenizer (one digit per token, NFC), no BOS, <|endoftext|> as pad and
    as the tokenizer's EOS, <|im_start|>/<|im_end|> chat turns, <think>/</think> as ordinary
    (non-special) added tokens, the chat template in tokenizer_config.json, and
    generation_config.json's eos_token_id = [<|im_end|>, <|endoftext|>].
  "llama3": Llama 3's pre-tokenizer (up to three digits per token, `ignore_merges`), a
    <|begin_of_text|> BOS written by the chat template, <|start_header_id|>/<|end_header_id|>,
    <|eot_id|> as the tokenizer's EOS, no pad token, the chat template in chat_template.jinja,
    and generation_config.json's eos_token_id = [<|end_of_text|>, <|eom_id|>, <|eot_id|>].

Both chat templates were written for this project in the style of the originals; the Qwen3 one
drops the reasoning of assistant turns before the last user message and, with
`enable_thinking=False`, opens the reply with an empty think block.
"""

from __future__ import annotations

import functools
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from tokenizers.trainers import BpeTrainer

STYLES = ("qwen3", "llama3")

# Size of the trained base vocabulary (256 bytes + merges); added tokens come after it.
BASE_VOCAB_SIZE = 448

_QWEN_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in id order, appended after the base vocabulary as the originals do.
ADDED_TOKENS = {
  "qwen3": (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<think>", False),
    ("</think>", False),
  ),
  "llama3": (
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eom_id|>", True),
    ("<|eot_id|>", True),
    ("<|python_tag|>", True),
  ),
}

CORPUS = (
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
  "May. How many clips did Natalia sell altogether in April and May?",
  "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
  "How much did she earn?",
  "Betty is saving money for a new wallet which costs $100. Betty has only half of the money "
  "she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice "
  "as much as her parents. How much more money does Betty need to buy the wallet?",
  "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
  "write a year?",
  "Albert buys 2 large pizzas and 2 small pizzas. A large pizza has 16 slices and a small "
  "pizza has 8 slices. If he eats it all, how many pieces does he eat that day?",
  "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total "
  "does it take?",
  "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
  "muffins for her friends every day with four. She sells the remainder at the farmers' market "
  "daily for $2 per fresh duck egg. How much in dollars does she make every day?",
  "Let's think step by step. 48 / 2 = 24 clips in May. 48 + 24 = 72 clips in total.\n"
  "The answer is 72.",
  "First, find the hourly rate per minute: 12 / 60 = 0.2 dollars. Then 0.2 * 50 = 10.\n#### 10",
  "So the total is 16 + 16 + 8 + 8 = 48 pieces. The final answer is \\boxed{48}.",
  "You are a helpful assistant. Please reason step by step, and put your final answer within "
  "\\boxed{}.",
  "Hello! How can I help you today? I'd like to solve a math problem, please.",
  "Sure, I can help with that. What's the problem you're working on?",
  "Think about the question carefully before you answer. We're given that x + 3 = 10, so x = 7.",
  "The user wants the sum of the numbers from 1 to 100: 100 * 101 / 2 = 5050.",
  "Okay, so I need to compute 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 340 + 51 = 391.",
  "Wait, let me double-check: 391 / 17 = 23. Yes, that's correct.",
  "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
  'Tools: {"name": "calculator", "arguments": {"expression": "2 + 2"}}',
  "Café, naïve, résumé: accents appear in some problems. 温度是 25 度。 Ответ: 42.",
  "Count the apples: there are 3 baskets with 12 apples each, so 3 * 12 = 36 apples.",
  "If a train travels 60 miles per hour for 2.5 hours, it covers 150 miles.",
  "The rectangle is 8 cm long and 5 cm wide; its area is 40 square centimeters.",
)


def _style_of(style: str) -> str:
  if style not in STYLES:
    raise ValueError(f"unknown tokenizer style {style!r}; known styles are {STYLES}")
  return style


@functools.cache
def _tokenizer_json(style: str) -> str:
  """The trained tokenizer, serialised; cached so every directory of a style is identical."""
  split = _QWEN_SPLIT if style == "qwen3" else _LLAMA_SPLIT
  tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
  if style == "qwen3":
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre.Sequence(
    [
      pre.Split(Regex(split), behavior="isolated", invert=False),
      pre.ByteLevel(add_prefix_space=False, trim_offsets=style == "llama3", use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = BpeTrainer(
    vocab_size=BASE_VOCAB_SIZE,
    min_frequency=2,
    initial_alphabet=pre.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(CORPUS * 2, trainer=trainer)
  for content, special in ADDED_TOKENS[style]:
    token = AddedToken(content, special=special, normalized=False)
    if special:
      tok.add_special_tokens([token])
    else:
      tok.add_tokens([token])
  if style == "qwen3":
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  else:
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
      [
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
          single="<|begin_of_text|> $A",
          pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
          special_tokens=[("<|begin_of_text|>", bos)],
        ),
      ]
    )
  data = json.loads(tok.to_str())
  if style == "llama3":
    # Llama 3 keeps a word whole when the vocabulary has it, whatever the merges would build.
    data["model"]["ignore_merges"] = True
  return json.dumps(data, ensure_ascii=False, indent=2)


def _added_tokens_decoder(style: str) -> dict[str, dict]:
  ids = json.loads(_tokenizer_json(style))["added_tokens"]
  return {
    str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word")}
    | {"special": t["special"]}
    for t in ids
  }


def token_id(style: str, content: str) -> int:
  """The id of added token `content` in tokenizers written with `style`."""
  for i, t in _added_tokens_decoder(_style_of(style)).items():
    if t["content"] == content:
      return int(i)
  raise KeyError(f"{content!r} is not an added token of style {style!r}")


QWEN3_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}
# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

Answer a call inside <tool_call></tool_call> tags.<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{#- Reasoning is kept only in the assistant turns after the last user message. #}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
  {%- if message.role == 'user' %}
    {%- set ns.last_query = messages | length - 1 - loop.index0 %}
    {%- break %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- if not loop.first %}
      {{- raise_exception('A system message may only come first.') }}
    {%- endif %}
  {%- elif message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
    {%- set content = message.content | default('', true) %}
    {%- set reasoning = message.reasoning_content | default('', true) %}
    {%- if not reasoning and '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
<|im_start|>assistant
{% if loop.index0 > ns.last_query and reasoning %}
<think>
{{ reasoning.strip('\\n') }}
</think>

{% endif %}
{{ content }}
    {%- for call in message.tool_calls | default([]) %}
      {%- set call = call.function | default(call) %}

<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>
    {%- endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
    {{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

{% endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if date_string is not defined %}
  {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{%- if messages[0].role == 'system' %}
  {%- set system = messages[0].content | trim %}
{%- else %}
  {%- set system = '' %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

Cutting Knowledge Date: December 2023
Today Date: {{ date_string }}

{% if tools %}
You have access to these functions:
{% for tool in tools %}
{{ tool | tojson(indent=4) }}
{% endfor %}

{% endif %}
{{ system }}<|eot_id|>
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- continue %}
  {%- endif %}
  {%- if message.role not in ['user', 'assistant', 'ipython'] %}
    {{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if message.role == 'assistant' %}
{% generation %}{{ message.content | trim }}<|eot_id|>{% endgeneration %}
{% else %}
{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""


def _configs(style: str) -> tuple[dict, dict, dict]:
  """tokenizer_config.json, special_tokens_map.json and generation_config.json of `style`."""
  added = _added_tokens_decoder(style)
  if style == "qwen3":
    tokenizer_config = {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": added,
      "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
      "bos_token": None,
      "chat_template": QWEN3_TEMPLATE,
      "clean_up_tokenization_spaces": False,
      "eos_token": "<|endoftext|>",
      "errors": "replace",
      "model_max_length": 4096,
      "pad_token": "<|endoftext|>",
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
    }
    special_map = {
      "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
      "eos_token": "<|endoftext|>",
      "pad_token": "<|endoftext|>",
    }
    eos = [token_id(style, "<|im_end|>"), token_id(style, "<|endoftext|>")]
    generation = {"bos_token_id": token_id(style, "<|endoftext|>"), "eos_token_id": eos}
  else:
    tokenizer_config = {
      "added_tokens_decoder": added,
      "bos_token": "<|begin_of_text|>",
      # Llama 3 ships True; transformers 5 ignores it for BPE tokenizers.
      "clean_up_tokenization_spaces": True,
      "eos_token": "<|eot_id|>",
      "model_input_names": ["input_ids", "attention_mask"],
      "model_max_length": 4096,
      "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    eos = [token_id(style, t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    generation = {"bos_token_id": token_id(style, "<|begin_of_text|>"), "eos_token_id": eos}
  generation |= {"do_sample": True, "temperature": 0.6, "top_p": 0.95}
  return tokenizer_config, special_map, generation


def write_tokenizer(directory: str | os.PathLike, style: str = "qwen3") -> str:
  """Writes a tokenizer of `style` ("qwen3" or "llama3") into `directory` and returns it.

  The directory is created if needed; a tokenizer written there before is replaced (its
  chat_template.jinja removed if this style has none), other files (a checkpoint's config.json
  and weights) are left alone. The same style always writes the
  same files. Load it with `jaxrl.data.load_tokenizer(directory)` (its `vocab_size` sizes a tiny
  model's embedding) or, to compare, `transformers.AutoTokenizer.from_pretrained(directory)`.
  """
  style = _style_of(style)
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  tokenizer_config, special_map, generation = _configs(style)
  files = {
    "tokenizer.json": _tokenizer_json(style),
    "special_tokens_map.json": json.dumps(special_map, indent=2),
    "generation_config.json": json.dumps(generation, indent=2),
  }
  if style == "llama3":
    files["chat_template.jinja"] = LLAMA3_TEMPLATE
  files["tokenizer_config.json"] = json.dumps(tokenizer_config, ensure_ascii=False, indent=2)
  stale = os.path.join(directory, "chat_template.jinja")
  if "chat_template.jinja" not in files and os.path.exists(stale):
    os.remove(stale)
  for name, text in files.items():
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
      f.write(text)
  return directory
