"""Prompt data for RL: tokenizers, verifiable tasks with rewards, and the prompt loader."""

from jaxrl.data.gsm8k import DatasetError, extract_final_answer, load_jsonl
from jaxrl.data.pipeline import PromptLoader
from jaxrl.data.tasks import TASKS, Task, TaskConfig, evaluate_countdown, make_task, split_of
from jaxrl.data.tokenizer import TOKENIZERS, ByteTokenizer, CharTokenizer, Tokenizer

__all__ = [
  "TASKS",
  "TOKENIZERS",
  "ByteTokenizer",
  "CharTokenizer",
  "DatasetError",
  "PromptLoader",
  "Task",
  "TaskConfig",
  "Tokenizer",
  "evaluate_countdown",
  "extract_final_answer",
  "load_jsonl",
  "make_task",
  "split_of",
]
