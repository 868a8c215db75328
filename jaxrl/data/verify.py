"""Math answer checking with math-verify, in worker processes with a wall-clock timeout per item.

`parse_gold` and `answer_is_correct` are the rule: a gold answer is the text of a final answer
("1,000", "\\frac{1}{2}", "x^2+1"), parsed as LaTeX inside `\\boxed{}`; a response is parsed
with math-verify's default extraction (its last `\\boxed{}` first, else the last expression),
and the two are compared with `math_verify.verify` (numerically and symbolically: 0.5 and
\\frac12, 1000 and 1,000 are equal). A response with nothing parseable is wrong.

`VerifierPool` runs that rule in processes of their own, started with `subprocess` (exec, not
fork: the parent runs JAX, which is multithreaded) from this file as a script, so that no
worker re-imports the user's `__main__` (a notebook run as a script would run again in every
worker, as it would under multiprocessing's spawn). Each item is bounded twice. Inside the
worker, a SIGALRM set for the whole item (parse and verify) interrupts math-verify after
`timeout_s`: signals work there because the worker calls math-verify in its main thread, which
math-verify's own signal-based timeout needs too; that one is turned off, since it reports a
timeout as a plain "wrong" that could not be counted. And the parent kills a worker that has
not answered `grace_s` later (C code that the signal cannot interrupt, a crash) and starts
another. Either way the item scores 0 and is counted, so nothing hangs and nothing is silently
wrong.

math-verify is imported only inside the workers; a parent without it fails when a pool is made.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_START_TIMEOUT_S = 120.0  # a worker imports sympy and math-verify before it is ready.
_MAX_START_FAILURES = 3  # workers in a row that die before they are ready: then give up.


# -- the rule ---------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`.

  Braces escaped as `\\{` `\\}` do not count. Returns None when there is no such box or its
  braces do not close (a response cut off inside its answer).
  """
  start = max(text.rfind(command) for command in _BOX_COMMANDS)
  if start < 0:
    return None
  i = start + 1
  while i < len(text) and text[i].isalpha():
    i += 1
  while i < len(text) and text[i].isspace():
    i += 1
  if i >= len(text) or text[i] != "{":
    return None
  depth, begin = 0, i + 1
  while i < len(text):
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[begin:i]
    i += 1
  return None


def answer_part(response: str) -> str:
  """What a response answers with: the text after its reasoning, that is after the last
  `</think>`; "" when a `<think>` never closes (cut off while thinking: no answer); the whole
  response when it has neither. A guess boxed while thinking is not the answer, and scoring
  it would teach the model to box guesses there. (A template that opens `<think>` in the
  prompt leaves a response cut off mid-thought with no tag: that one is scored whole.)"""
  if "</think>" in response:
    return response.rsplit("</think>", 1)[1]
  return "" if "<think>" in response else response


def has_boxed_answer(response: str) -> bool:
  """The format check: the last `\\boxed{}` of the response's answer (`answer_part`) is closed
  and not empty."""
  content = last_boxed(answer_part(response))
  return content is not None and bool(content.strip())


def parse_gold(answer: str) -> list:
  """Parses a gold final answer with math-verify, as the LaTeX of `\\boxed{answer}`.

  Runs without math-verify's own timeout: call it where a timeout is in place (a worker).

  Raises:
    ValueError: math-verify finds no expression in it.
  """
  from math_verify import LatexExtractionConfig, parse

  parsed = parse(
    f"\\boxed{{{answer}}}",
    extraction_config=[LatexExtractionConfig()],
    fallback_mode="no_fallback",
    parsing_timeout=None,
  )
  if not parsed:
    raise ValueError("math-verify finds no expression in it")
  return parsed


# Gold answers math-verify parses whatever they hold (`tests/data/verify_test.py` checks the
# forms): optional sign, digits, optional decimal part.
PLAIN_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")
_gold = functools.lru_cache(maxsize=4096)(parse_gold)  # each gold is checked group-size times.


def answer_is_correct(answer: str, response: str) -> bool:
  """Whether the final answer in `response` (after its reasoning, `answer_part`) equals the
  gold `answer` (math-verify)."""
  from math_verify import parse, verify

  try:
    gold = _gold(answer)
  except ValueError:
    return False
  answer = parse(answer_part(response), parsing_timeout=None)
  return bool(verify(gold, answer, timeout_seconds=None))


# -- the worker (this file run as a script) ----------------------------------------------------


class _ItemTimeout(BaseException):
  """Raised by SIGALRM; a BaseException so that sympy's `except Exception` cannot swallow it."""


def _on_alarm(signum, frame):
  raise _ItemTimeout


def _handle(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  """Replies `{"correct": bool}` (score), `{"reason": str | None}` (gold) or `{"error": str}`,
  with `"timed_out": True` when the alarm ended it."""
  signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    if request["op"] == "gold":
      try:
        parse_gold(request["answer"])
      except ValueError as e:
        return {"reason": str(e)}
      return {"reason": None}
    return {"correct": answer_is_correct(request["answer"], request["response"])}
  except _ItemTimeout:
    return {"error": f"timed out after {timeout_s:g} s", "timed_out": True}
  except Exception as e:  # reported to the parent, which counts the item.
    return {"error": f"{type(e).__name__}: {e}"}
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


def _serve(timeout_s: float) -> None:
  """A worker's main loop: one JSON request per line on stdin, one JSON reply per line."""
  out = os.dup(1)
  os.dup2(2, 1)  # stray prints go to stderr, not into the replies.
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  signal.signal(signal.SIGALRM, _on_alarm)
  # Its "timeout is disabled" warning: the timeout is the alarm above.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  answer_is_correct("\\frac{1}{2}", "\\boxed{0.5}")  # the first parse is slow: not an item's.
  _write_line(out, {"ready": True})
  for line in sys.stdin.buffer:
    try:
      reply = _handle(json.loads(line), timeout_s)
    except _ItemTimeout:  # the alarm fired as `_handle` returned.
      reply = {"error": f"timed out after {timeout_s:g} s", "timed_out": True}
    _write_line(out, reply)


def _write_line(fd: int, message: dict[str, Any]) -> None:
  data = memoryview((json.dumps(message) + "\n").encode())
  while data:
    data = data[os.write(fd, data) :]


# -- the pool ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdicts:
  """A batch's results: `correct_b[i]` is item i's verdict; `failed_b[i]` that it timed out or
  its worker crashed (it is then not correct)."""

  correct_b: np.ndarray
  failed_b: np.ndarray

  @property
  def failures(self) -> int:
    return int(self.failed_b.sum())


@dataclasses.dataclass
class _Job:
  op: str
  requests: list[dict[str, Any]]
  future: Future
  results: list[Any]
  failed: list[bool]
  remaining: int


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  deadline: float  # to be ready, or to answer the current item
  ready: bool = False
  item: tuple[_Job, int] | None = None
  buffer: bytes = b""


class VerifierPool:
  """Processes that check math answers, shared by any number of threads.

  Nothing starts until the first request; `close()` (or leaving a `with` block, or interpreter
  exit) stops the workers. Submitting never blocks: results come back as futures, completed by
  a thread of the pool.

  Example:
    with VerifierPool(num_workers=4, timeout_s=5.0) as pool:
      verdicts = pool.verify(["\\\\frac{1}{2}"], ["so \\\\boxed{0.5}"]).result()
  """

  def __init__(
    self,
    num_workers: int,
    timeout_s: float,
    *,
    grace_s: float = 2.0,
    worker_script: str | None = None,
  ):
    """Makes a pool; its processes start with the first request.

    Args:
      num_workers: worker processes.
      timeout_s: the most seconds one item may take inside its worker.
      grace_s: seconds after `timeout_s` when the parent kills a worker that has not answered.
      worker_script: the script the workers run; by default this file. A test may run a
        script that changes the rule and then calls `_serve`.

    Raises:
      ImportError: math-verify is not installed.
    """
    if num_workers < 1 or timeout_s <= 0 or grace_s <= 0:
      raise ValueError(
        f"VerifierPool(num_workers={num_workers}, timeout_s={timeout_s}, grace_s={grace_s}): "
        "all must be positive."
      )
    if importlib.util.find_spec("math_verify") is None:
      raise ImportError(
        "The math task checks answers with math-verify, which is not installed; "
        "pip install 'jaxrl[hf]' (or 'math-verify[antlr4_13_2]')."
      )
    self.num_workers = num_workers
    self.timeout_s = timeout_s
    self.grace_s = grace_s
    self.worker_script = worker_script or os.path.abspath(__file__)
    self.workers_replaced = 0  # workers killed or lost while busy, and started again
    self._lock = threading.Lock()
    self._submitted: collections.deque[_Job] = collections.deque()
    self._thread: threading.Thread | None = None
    self._closed = False
    self._wake_r = self._wake_w = -1  # a pipe that wakes the pool's thread
    # Owned by the pool's thread:
    self._selector: selectors.BaseSelector | None = None
    self._workers: list[_Worker] = []
    self._pending: collections.deque[tuple[_Job, int]] = collections.deque()
    self._start_failures = 0  # workers in a row that exited before they were ready

  # -- the public calls ---------------------------------------------------------------------------

  def verify(self, answers: Sequence[str], responses: Sequence[str]) -> Future:
    """Checks each response against its gold answer; a future of `Verdicts`."""
    if len(answers) != len(responses):
      raise ValueError(f"{len(answers)} answers but {len(responses)} responses.")
    requests = [
      {"op": "score", "answer": a, "response": r} for a, r in zip(answers, responses, strict=True)
    ]
    return self._submit("score", requests)

  def check_answers(self, answers: Sequence[str]) -> Future:
    """Parses gold answers; a future of a list with None for each parsed answer and the reason
    for each answer that did not parse (or timed out). Plain decimal numbers (GSM8K's answers)
    parse by construction (`PLAIN_NUMBER`): they pass without a worker, so a dataset of them
    is checked at once, with no process started (a generated GSM8K-sized file loaded in 12 s
    before, 0.25 s since, on the 2-core VM: docs/BENCHMARKS.md)."""
    others = [i for i, a in enumerate(answers) if not PLAIN_NUMBER.fullmatch(a)]
    checked = self._submit("gold", [{"op": "gold", "answer": answers[i]} for i in others])

    def all_answers(reasons: list) -> list:
      out = [None] * len(answers)
      for i, reason in zip(others, reasons, strict=True):
        out[i] = reason
      return out

    return then(checked, all_answers)

  def close(self) -> None:
    """Stops the workers; pending requests fail with RuntimeError. Safe to call twice."""
    with self._lock:
      self._closed = True
      self._wake()
      thread = self._thread
    if thread is not None and thread is not threading.current_thread():
      thread.join()

  def __enter__(self) -> VerifierPool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # -- submitting ---------------------------------------------------------------------------------

  def _submit(self, op: str, requests: list[dict[str, Any]]) -> Future:
    future = Future()
    future.set_running_or_notify_cancel()  # it can no longer be cancelled under the pool.
    n = len(requests)
    job = _Job(op, requests, future, results=[None] * n, failed=[False] * n, remaining=n)
    if not requests:
      _finish(job)
      return future
    with self._lock:
      if self._closed:
        raise RuntimeError("VerifierPool is closed.")
      self._submitted.append(job)
      if self._thread is None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="VerifierPool", daemon=True)
        self._thread.start()
        # A daemon thread is not joined at exit: without this, workers would outlive us.
        atexit.register(_close_pool, weakref.ref(self))
      self._wake()
    return future

  def _wake(self) -> None:
    """Wakes the pool's thread; called under the lock, which keeps the pipe open meanwhile."""
    if self._wake_w >= 0:
      # A full pipe wakes the thread as well as one more byte would.
      with contextlib.suppress(BlockingIOError):
        os.write(self._wake_w, b"x")

  # -- the pool's thread --------------------------------------------------------------------------

  def _run(self) -> None:
    self._selector = selectors.DefaultSelector()
    self._selector.register(self._wake_r, selectors.EVENT_READ, None)
    error: BaseException = RuntimeError("VerifierPool is closed.")
    try:
      while True:
        with self._lock:
          if self._closed:
            break
          while self._submitted:
            job = self._submitted.popleft()
            self._pending.extend((job, i) for i in range(len(job.requests)))
        if self._pending and len(self._workers) < self.num_workers:
          for _ in range(self.num_workers - len(self._workers)):
            self._start_worker()
        self._dispatch()
        for key, _ in self._selector.select(self._wait_s()):
          if key.data is None:
            while _read_some(self._wake_r):
              pass
          else:
            self._read(key.data)
        self._expire()
    except BaseException as e:  # every waiting caller gets it.
      log.exception("VerifierPool's thread failed")
      error = e
    finally:
      self._shut_down(error)

  def _start_worker(self) -> None:
    env = dict(os.environ)
    # The workers import what the parent can: its sys.path ('' meaning the current directory).
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    proc = subprocess.Popen(
      [sys.executable, "-P", self.worker_script, repr(self.timeout_s)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      env=env,
      bufsize=0,
    )
    os.set_blocking(proc.stdout.fileno(), False)
    worker = _Worker(proc, deadline=time.monotonic() + _START_TIMEOUT_S)
    self._workers.append(worker)
    self._selector.register(proc.stdout.fileno(), selectors.EVENT_READ, worker)

  def _dispatch(self) -> None:
    for worker in list(self._workers):
      if not self._pending:
        return
      if not worker.ready or worker.item is not None:
        continue
      job, index = self._pending.popleft()
      try:
        _write_line(worker.proc.stdin.fileno(), job.requests[index])
      except OSError:  # it died while idle: the item never started, so it goes back.
        self._pending.appendleft((job, index))
        self._remove(worker)
        continue
      worker.item = (job, index)
      worker.deadline = time.monotonic() + self.timeout_s + self.grace_s

  def _wait_s(self) -> float | None:
    deadlines = [w.deadline for w in self._workers if not w.ready or w.item is not None]
    return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

  def _read(self, worker: _Worker) -> None:
    data = _read_some(worker.proc.stdout.fileno())
    if data == b"":
      self._lost(worker, "its worker process exited")
      return
    worker.buffer += data or b""
    *lines, worker.buffer = worker.buffer.split(b"\n")
    for line in lines:
      try:
        reply = json.loads(line)
      except ValueError:
        self._lost(worker, f"its worker wrote {line[:80]!r}, not a reply")
        return
      if not worker.ready:
        worker.ready = True
        self._start_failures = 0
      elif worker.item is not None:
        (job, index), worker.item = worker.item, None
        if "error" in reply:
          # Timeouts are expected now and then (and counted); other errors are not.
          level = logging.INFO if reply.get("timed_out") else logging.WARNING
          log.log(level, "An answer check failed and scores 0: %s.", reply["error"])
          self._fail(job, index, reply["error"])
        else:
          job.results[index] = reply["correct"] if job.op == "score" else reply["reason"]
          _count_down(job)

  def _expire(self) -> None:
    now = time.monotonic()
    for worker in list(self._workers):
      if worker.deadline <= now and not (worker.ready and worker.item is None):
        self._lost(worker, "no answer in time" if worker.ready else "not ready in time")

  def _lost(self, worker: _Worker, reason: str) -> None:
    """A worker that hung or died: killed, and its item (if any) scored 0 and counted."""
    self._remove(worker)
    if worker.item is not None:
      job, index = worker.item
      log.warning("A reward worker was replaced (%s); its item scores 0.", reason)
      self.workers_replaced += 1
      self._fail(job, index, f"its worker was replaced ({reason})")
    elif not worker.ready:
      self._start_failures += 1
      if self._start_failures >= _MAX_START_FAILURES:
        self._start_failures = 0
        error = RuntimeError(
          f"{_MAX_START_FAILURES} reward workers in a row exited before they were ready "
          f"({reason}); their error is on stderr above. Worker: {self.worker_script}"
        )
        for job in {id(job): job for job, _ in self._pending}.values():
          _fail_job(job, error)
        self._pending.clear()

  def _remove(self, worker: _Worker) -> None:
    self._workers.remove(worker)
    self._selector.unregister(worker.proc.stdout.fileno())
    _kill(worker.proc)

  def _fail(self, job: _Job, index: int, reason: str) -> None:
    job.failed[index] = True
    job.results[index] = reason if job.op == "gold" else False
    _count_down(job)

  def _shut_down(self, error: BaseException) -> None:
    jobs = [job for job, _ in self._pending]
    for worker in self._workers:
      _kill(worker.proc)  # workers keep no state: nothing to wait for.
      if worker.item is not None:
        jobs.append(worker.item[0])
    self._workers.clear()
    self._pending.clear()
    self._selector.close()
    with self._lock:
      os.close(self._wake_r)
      os.close(self._wake_w)
      self._wake_r = self._wake_w = -1
      self._closed = True
      jobs += self._submitted
      self._submitted.clear()
    for job in {id(job): job for job in jobs}.values():
      _fail_job(job, error)


def _read_some(fd: int) -> bytes | None:
  """Up to 64 KiB from a non-blocking fd; b"" at its end, None if nothing is there now."""
  try:
    return os.read(fd, 1 << 16)
  except BlockingIOError:
    return None


def _kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  for stream in (proc.stdin, proc.stdout):
    stream.close()


def _count_down(job: _Job) -> None:
  job.remaining -= 1
  if job.remaining == 0:
    _finish(job)


def _finish(job: _Job) -> None:
  if job.op == "gold":
    result = list(job.results)
  else:
    result = Verdicts(
      correct_b=np.array([bool(r) for r in job.results], bool),
      failed_b=np.array(job.failed, bool),
    )
  with contextlib.suppress(InvalidStateError):  # already failed by a shut-down
    job.future.set_result(result)


def _fail_job(job: _Job, error: BaseException) -> None:
  with contextlib.suppress(InvalidStateError):
    job.future.set_exception(error)


def _close_pool(ref: weakref.ref) -> None:
  pool = ref()
  if pool is not None:
    pool.close()


def then(future: Future, fn: Callable[[Any], Any]) -> Future:
  """A future of `fn(future.result())`, or of `future`'s exception."""
  out = Future()
  out.set_running_or_notify_cancel()

  def done(f: Future) -> None:
    try:
      out.set_result(fn(f.result()))
    except BaseException as e:  # handed to whoever waits on `out`.
      out.set_exception(e)

  future.add_done_callback(done)
  return out


if __name__ == "__main__":
  _serve(float(sys.argv[1]))
