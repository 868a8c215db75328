"""The metrics file across a resume: the steps after the checkpoint are written once, a record
cut short by a kill does not stop the next run, and the resumed eval is read back."""

import json

import pytest

from jaxrl.metrics import MetricsWriter, read_metrics


def _write(writer, kind, steps):
  for step in steps:
    writer.write(step, kind, {"eval_reward" if kind == "eval" else "loss": step / 10})


def test_a_resume_rewrites_the_steps_after_its_checkpoint_once(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  _write(writer, "warmup", [1, 2, 3])
  _write(writer, "eval", [0])
  _write(writer, "train", [1, 2, 3])
  _write(writer, "eval", [2])
  writer.close()
  with open(writer.path, "a") as f:
    f.write('{"step": 4, "kind": "tra')  # killed mid-write
  resumed = MetricsWriter(str(tmp_path), tensorboard=False)
  resumed.truncate_after(2)  # the checkpoint of step 2: steps 3 and 4 run again
  assert resumed.recorded("eval", 2) == {"step": 2, "kind": "eval", "eval_reward": 0.2}
  assert resumed.recorded("eval", 3) is None
  _write(resumed, "train", [3, 4])
  resumed.close()
  rows = [(r["kind"], r["step"]) for r in read_metrics(resumed.path)]
  assert rows == [
    *[("warmup", s) for s in (1, 2, 3)], ("eval", 0), ("train", 1), ("train", 2), ("eval", 2),
    ("train", 3), ("train", 4),
  ]  # fmt: skip


def test_a_record_cut_short_is_dropped_even_with_nothing_to_rewrite(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  _write(writer, "train", [1, 2])
  writer.close()
  with open(writer.path, "a") as f:
    f.write('{"step": 3, "kind": "tra')
  resumed = MetricsWriter(str(tmp_path), tensorboard=False)
  resumed.truncate_after(2)
  _write(resumed, "train", [3])
  resumed.close()
  assert [r["step"] for r in read_metrics(resumed.path)] == [1, 2, 3]


def test_a_broken_record_before_the_last_is_an_error(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "kind": "train"}\nnot json\n' + json.dumps({"step": 2}) + "\n")
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
    read_metrics(str(path))
