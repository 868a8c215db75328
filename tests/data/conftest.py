"""Fixtures of the tokenizer tests: one directory per style written by
tests/helpers/hf_tokenizers.py, loaded by jaxrl and by transformers."""

import pytest
from helpers import hf_tokenizers

from jaxrl.data.hf_tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def auto_tokenizer():
  return pytest.importorskip("transformers").AutoTokenizer


@pytest.fixture(scope="module", params=hf_tokenizers.STYLES)
def style(request):
  return request.param


@pytest.fixture(scope="module")
def directory(style, tmp_path_factory):
  return hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp(style), style)


@pytest.fixture(scope="module")
def ours(directory):
  return load_tokenizer(directory)


@pytest.fixture(scope="module")
def theirs(directory, auto_tokenizer):
  return auto_tokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  return load_tokenizer(hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("q"), "qwen3"))


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  return hf_tokenizers.write_tokenizer(tmp_path_factory.mktemp("l"), "llama3")
