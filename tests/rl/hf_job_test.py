"""End to end from a Hugging Face checkpoint: GRPO steps on a tiny Qwen3 fixture with its own
tokenizer and chat template on the project's math sample, then the exported policy opens in
transformers with the weights the learner trained."""

import os

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers import hf_checkpoints  # noqa: E402

from jaxrl.config import ConfigError, load_config  # noqa: E402
from jaxrl.metrics import read_metrics  # noqa: E402
from jaxrl.model import load_pretrained  # noqa: E402
from jaxrl.rl import job  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_hf.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_tiny")
  return hf_checkpoints.write_checkpoint(path, "qwen3", tied=True, tokenizer="qwen3")


class Killed(BaseException):
  pass


@pytest.fixture(scope="module")
def killed_and_resumed(checkpoint, tmp_path_factory):
  """The test variant's run (2 GRPO steps, evals, an export at step 1), killed while it writes
  its final export (a part-written file left behind), then resumed: its workdir and the
  resumed run's summary. Both tests below read this one run: each run compiles the fixture
  model's programs, tens of seconds on 2 cores."""
  from jaxrl.rl import policy

  real = policy.save_pretrained

  def dies_in_final(model, params, out_dir, **kwargs):
    if out_dir.endswith("final"):
      os.makedirs(out_dir, exist_ok=True)
      with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 100)  # part-written
      raise Killed
    return real(model, params, out_dir, **kwargs)

  workdir = str(tmp_path_factory.mktemp("hf_job") / "run")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(policy, "save_pretrained", dies_in_final)
    with pytest.raises(Killed):
      job.run(
        load_config(CONFIG, "test", {"pretrained.path": checkpoint}), workdir, show_progress=False
      )
  resumed = load_config(CONFIG, "test", {"pretrained.path": checkpoint, "resume": True})
  return workdir, job.run(resumed, workdir, show_progress=False)


def test_grpo_from_checkpoint_exports_a_policy_transformers_opens(checkpoint, killed_and_resumed):
  workdir, summary = killed_and_resumed
  assert summary["steps"] == 2

  records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)
  assert all(r["reward_timeouts"] == 0 and "entropy" in r for r in train)
  evals = [r for r in records if r["kind"] == "eval"]
  assert len(evals) == 2 and all(0.0 <= r["eval_pass_at_1"] <= 1.0 for r in evals)

  final = os.path.join(workdir, "hf", "final")
  assert os.path.isdir(os.path.join(workdir, "hf", "step_000001"))
  for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    assert os.path.exists(os.path.join(final, name)), name

  # The export holds the trained weights (not the checkpoint's), and transformers reads them
  # to the logits jaxrl computes from them.
  model, trained = load_pretrained(final, dtype="float32")
  _, original = load_pretrained(checkpoint, dtype="float32")
  moved = [
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(_leaves(trained), _leaves(original), strict=True)
  ]
  assert max(moved) > 0, "the exported policy equals the starting checkpoint: nothing trained"
  tokens = np.random.default_rng(0).integers(0, 400, (1, 48))
  ours = np.asarray(model.apply(trained, tokens)[0])
  theirs = hf_checkpoints.logits(hf_checkpoints.load_model(final), tokens)
  # Exported in bf16 (checkpoint.hf_dtype), read back in fp32 by both.
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


def _leaves(tree):
  return jax.tree.leaves(tree)


def test_a_run_killed_while_exporting_exports_again_when_resumed(killed_and_resumed):
  workdir, _ = killed_and_resumed
  final = os.path.join(workdir, "hf", "final")
  assert os.path.getsize(os.path.join(final, "model.safetensors")) > 100  # written again, whole
  model, _ = load_pretrained(final, dtype="float32")
  assert model.config.num_layers > 0


def test_tokenizer_key_errors_name_the_key(checkpoint, tmp_path):
  with pytest.raises(ConfigError, match="config.tokenizer"):
    job.run(
      load_config(CONFIG, "test", {"pretrained.path": checkpoint, "tokenizer": str(tmp_path)}),
      str(tmp_path / "run"),
      show_progress=False,
    )
  with pytest.raises(ConfigError, match="config.pretrained.path"):
    job.run(
      load_config(CONFIG, "test", {"pretrained.path": str(tmp_path / "missing")}),
      str(tmp_path / "run2"),
      show_progress=False,
    )


@pytest.mark.parametrize("prompts", ["chat", "plain"])
def test_warm_up_rows_are_what_the_chat_template_renders(tmp_path, prompts):
  """A (prompt, answer) warm-up row ends the answer with the template's end of turn (Qwen's
  <|im_end|>), not the tokenizer's EOS (<|endoftext|>): the ids the original renders. A plain
  text prompt (a record without messages) ends its answer with EOS."""
  import types

  from helpers import hf_tokenizers

  from jaxrl.data import load_tokenizer
  from jaxrl.data.prompts import encode_prompt
  from jaxrl.data.tasks import make_task

  directory = hf_tokenizers.write_tokenizer(tmp_path, "qwen3")
  overrides = {"pretrained.path": directory, "warmup.steps": 1, "warmup.batch_size": 2}
  cfg = load_config(CONFIG, "test", overrides)
  tok, task, rows = load_tokenizer(directory), make_task(cfg.task), []
  if prompts == "plain":
    chat_task = task
    task = types.SimpleNamespace(
      records=lambda *a: [
        {k: v for k, v in r.items() if k != "messages"} for r in chat_task.records(*a)
      ]
    )

  def step(tokens_bt, mask_bt):
    rows.extend(zip(tokens_bt.tolist(), mask_bt.tolist(), strict=True))
    return {"loss": 0.0}

  trainer = types.SimpleNamespace(step=step)
  controller = types.SimpleNamespace(
    backend=types.SimpleNamespace(supervised_trainer=lambda learner, lr: trainer),
    learner=types.SimpleNamespace(reset_reference=lambda: None),
    writer=types.SimpleNamespace(write=lambda *args: None),
    task=task,
    tokenizer=tok,
    episodes=None,
    chat={},
    encode_prompts=lambda batch: [encode_prompt(tok, r) for r in batch],
  )
  job.warmup(controller, cfg, show_progress=False)
  by_prompt = {tuple(encode_prompt(tok, r)): r for r in task.records("train", None, cfg.seed + 1)}
  assert len(rows) == 2
  for tokens, mask in rows:
    end = max(k for k, m in enumerate(mask) if m) + 2  # mask[k] is for tokens[k + 1]
    prompt, record = next((p, r) for p, r in by_prompt.items() if tuple(tokens[: len(p)]) == p)
    if prompts == "plain":
      assert tokens[:end] == [*prompt, *tok.encode(record["answer"]), tok.eos_id]
      continue
    chat = [*record["messages"], {"role": "assistant", "content": record["answer"]}]
    assert tokens[:end] == tok.apply_chat_template(chat, False)[:end]
    assert tokens[end - 1] == tok.token_to_id("<|im_end|>")
