"""Prompt data for RL: tokenizers (the project's own and Hugging Face ones with their chat
templates), verifiable tasks with rewards, and the prompt loader."""

from jaxrl.data.countdown import evaluate_countdown
from jaxrl.data.gsm8k import DatasetError, extract_final_answer, load_jsonl
from jaxrl.data.hf_tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from jaxrl.data.pipeline import PromptLoader
from jaxrl.data.prompts import encode_prompt
from jaxrl.data.task_base import RewardBatch, Task, split_of
from jaxrl.data.tasks import MATH_INSTRUCTION, TASKS, TaskConfig, make_task
from jaxrl.data.tokenizer import TOKENIZERS, ByteTokenizer, CharTokenizer, Tokenizer
from jaxrl.data.verify import VerifierPool

__all__ = [
  "MATH_INSTRUCTION",
  "TASKS",
  "TOKENIZERS",
  "ByteTokenizer",
  "CharTokenizer",
  "DatasetError",
  "HFTokenizer",
  "PromptLoader",
  "RewardBatch",
  "Task",
  "TaskConfig",
  "Tokenizer",
  "TokenizerError",
  "VerifierPool",
  "encode_prompt",
  "evaluate_countdown",
  "extract_final_answer",
  "load_jsonl",
  "load_tokenizer",
  "make_task",
  "split_of",
]
