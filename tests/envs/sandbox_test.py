"""The Python sandbox: limits end runaway code with a clear status; isolation where available.

The network and filesystem tests need Linux namespaces (`unshare` as root or with unprivileged
user namespaces); they skip, saying why, where `isolation()` finds none.
"""

import os
import random
import socket
import threading
import time
import uuid

import pytest

import jaxrl
from jaxrl.envs import SandboxLimits, isolation, run_python

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=1.0, memory_mb=256, max_output_chars=300)
needs_namespaces = pytest.mark.skipif(
  not isolation().namespaces, reason=f"no namespaces on this machine: {isolation().reason}"
)


def test_output_and_exit_status():
  rng = random.Random(0)
  a, b = rng.randint(10**5, 10**6), rng.randint(10**5, 10**6)
  result = run_python(f"import sys\nprint({a} * {b})\nprint('warn', file=sys.stderr)", LIMITS)
  assert (result.status, result.exit_code, result.truncated) == ("ok", 0, False)
  assert result.output == f"{a * b}\nwarn\n"
  error = run_python("x = 1\nraise ValueError('bad input')", LIMITS)
  assert (error.status, error.exit_code) == ("error", 1)
  assert "ValueError: bad input" in error.output and "line 2" in error.output
  assert run_python("import sys; sys.exit(3)", LIMITS).text(LIMITS) == "[exited with status 3]"
  assert run_python("pass", LIMITS).text(LIMITS) == "(no output)"


def test_an_infinite_loop_stops_at_the_cpu_limit():
  start = time.monotonic()
  result = run_python("while True:\n  pass", LIMITS)
  assert result.status == "cpu_limit" and result.exit_code is not None
  assert time.monotonic() - start < LIMITS.timeout_s
  assert result.text(LIMITS).endswith("[stopped: it used up its 1 s of CPU time]")


@pytest.mark.parametrize(
  "code",
  ["import sys; sys.exit(137)", "import sys; sys.exit(152)", "import os; os.kill(os.getpid(), 9)"],
  ids=["exit137", "exit152", "sigkill"],
)
def test_a_kill_or_exit_status_without_the_cpu_used_up_is_an_error(code):
  """Under namespaces a shell reports 137 and 152 as it would SIGKILL and SIGXCPU; a kill with
  CPU time to spare (the OOM killer's) is not the CPU limit either."""
  result = run_python(code, LIMITS)
  assert result.status == "error", result
  assert "CPU time" not in result.text(LIMITS)


def test_a_sleeping_run_stops_at_the_wall_clock_limit():
  # 3 s: on a loaded 2-core machine the child's interpreter once took over 1 s to print.
  limits = SandboxLimits(timeout_s=3.0, cpu_s=5.0, memory_mb=256)
  result = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", limits)
  assert (result.status, result.exit_code) == ("timeout", None)
  assert 3.0 <= result.elapsed_s < 8.0
  assert result.text(limits) == "start\n[stopped: it ran past the 3 s time limit]"


def test_memory_past_the_limit_is_a_memory_error():
  result = run_python("chunks = []\nwhile True:\n  chunks.append(bytearray(8 << 20))", LIMITS)
  assert result.status == "memory_limit"
  assert result.text(LIMITS).endswith("[stopped: it ran out of memory (limit 256 MB)]")
  # Under the limit, the same kind of allocation is fine.
  assert run_python("x = bytearray(64 << 20); print(len(x))", LIMITS).output == f"{64 << 20}\n"


def test_output_is_truncated_keeping_the_head_and_the_tail():
  rng = random.Random(1)
  lines = [f"{i}:{rng.random():.6f}" for i in range(2000)]
  result = run_python(f"for line in {lines!r}:\n  print(line)", LIMITS)
  text = "".join(f"{line}\n" for line in lines)
  assert result.status == "ok" and result.truncated
  head, tail = result.output.split("\n[... ", 1)
  assert head == text[:150]
  cut, rest = tail.split(" characters cut ...]\n", 1)
  assert rest == text[-150:] and int(cut) == len(text) - 300


def test_a_flood_of_output_is_kept_bounded():
  code = "import sys\nfor c in 'abc':\n  sys.stdout.write(c * (1 << 20))\nprint('end')"
  result = run_python(code, LIMITS)
  assert result.status == "ok" and result.truncated
  assert result.output.startswith("a" * 150 + "\n[... about ")
  assert result.output.endswith("c" * 146 + "end\n")
  assert f"about {3 * (1 << 20) + 4 - (1 << 20)} bytes cut" in result.output


def test_files_persist_in_a_given_workdir_and_the_environment_is_clean(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
  run_python("open('state.txt', 'w').write('41')", LIMITS, tmp_path)
  result = run_python(
    "import os\nprint(int(open('state.txt').read()) + 1)\n"
    "print(os.environ.get('JAXRL_TEST_SECRET'))\nprint(os.getcwd())",
    LIMITS,
    tmp_path,
  )
  assert result.output.splitlines() == ["42", "None", str(tmp_path)]
  assert (tmp_path / "state.txt").read_text() == "41"


@needs_namespaces
def test_the_network_is_unreachable_even_the_hosts_localhost():
  server = socket.create_server(("127.0.0.1", 0))
  port = server.getsockname()[1]
  accepted = []
  threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
  code = (
    "import socket\n"
    "for host in ['127.0.0.1', '1.1.1.1']:\n"
    "  s = socket.socket(); s.settimeout(2)\n"
    "  try:\n"
    f"    s.connect((host, {port})); print(host, 'connected')\n"
    "  except OSError as e:\n"
    "    print(host, 'refused', e.errno)\n"
  )
  result = run_python(code, LIMITS)
  server.close()
  assert result.status == "ok", result.output
  assert "connected" not in result.output and result.output.count("refused") == 2
  assert not accepted


@needs_namespaces
def test_nothing_is_written_outside_the_workdir():
  outside = os.path.join(os.path.dirname(jaxrl.__file__), f"sandbox-probe-{uuid.uuid4().hex}")
  scratch = f"/tmp/sandbox-probe-{uuid.uuid4().hex}"
  code = (
    f"for path in [{outside!r}, {scratch!r}, 'inside.txt']:\n"
    "  try:\n"
    "    open(path, 'w').write('x'); print('wrote', path)\n"
    "  except OSError as e:\n"
    "    print('denied', e.errno)\n"
  )
  try:
    result = run_python(code, LIMITS)
    # EROFS: the host's file system is read-only inside; ENOENT where the checkout is under
    # /tmp, which the sandbox replaces with its own (so the package's directory is not there).
    denied, *rest = result.output.splitlines()
    assert denied in ("denied 30", "denied 2") and rest == [f"wrote {scratch}", "wrote inside.txt"]
    assert not os.path.exists(outside)  # read-only file system
    assert not os.path.exists(scratch)  # /tmp is the run's own, gone with it
  finally:
    for path in (outside, scratch):
      if os.path.exists(path):
        os.remove(path)


@needs_namespaces
def test_background_processes_die_with_the_run(tmp_path):
  code = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', "
    '\'import time; time.sleep(0.2); open("late.txt", "w")\'], start_new_session=True)\n'
    "print('started')"
  )
  assert run_python(code, LIMITS, tmp_path).output == "started\n"
  time.sleep(0.6)
  assert not (tmp_path / "late.txt").exists()


def test_limits_are_checked():
  for field in ("timeout_s", "cpu_s", "memory_mb", "file_mb", "max_output_chars"):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be > 0"):
      SandboxLimits(**{field: 0})
