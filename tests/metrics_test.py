"""The metrics file across a resume: the steps after the checkpoint are written once, a record
cut short by a kill does not stop the next run, and the resumed eval is read back. TensorBoard
gets the scalars, and the writer does not import torch."""

import json
import subprocess
import sys

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


_TENSORBOARD_PROGRAM = """
import json, pathlib, struct, sys
from jaxrl.metrics import MetricsWriter

writer = MetricsWriter(sys.argv[1])
writer.write(3, "train", {"loss": 1.5, "note": "not a scalar"})
writer.close()
imported_torch = "torch" in sys.modules
from tensorboardX.proto import event_pb2  # the event files' records: length, crc, Event, crc

(path,) = (pathlib.Path(sys.argv[1]) / "tensorboard").iterdir()
data, at, scalars = path.read_bytes(), 0, []
while at < len(data):
  (size,) = struct.unpack("<Q", data[at : at + 8])
  event = event_pb2.Event.FromString(data[at + 12 : at + 12 + size])
  scalars += [[v.tag, event.step, v.simple_value] for v in event.summary.value]
  at += 12 + size + 4
print(json.dumps({"imported_torch": imported_torch, "scalars": scalars}))
"""


def test_tensorboard_gets_the_scalars_and_torch_is_not_imported(tmp_path):
  """tensorboardX imports torch where it is installed (4.5 s and 610 MB on the 2-core VM);
  the writer keeps it out of the process. In a process of its own: the test's may hold torch."""
  done = subprocess.run(
    [sys.executable, "-c", _TENSORBOARD_PROGRAM, str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  assert got == {"imported_torch": False, "scalars": [["train/loss", 3, 1.5]]}
