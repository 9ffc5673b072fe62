"""A small pool of grader subprocesses with a hard wall-clock limit per check.

Why subprocesses and not threads: a check stuck in C code (sympy, big-int arithmetic) cannot be
interrupted from another thread; a process can be killed. Why plain ``subprocess`` and not
``multiprocessing``/``ProcessPoolExecutor``: inside a Ray actor the main module is Ray's worker
script, which 'spawn'/'forkserver' would re-import in every child, 'fork' copies a multi-threaded
process, and an executor has no public way to kill one stuck worker. Here each worker is
``python -c <boot>`` speaking JSON lines: ``{"args": [...]}`` in on stdin, ``{"result": x}`` or
``{"error": "..."}`` out on a private pipe; a timed-out worker is killed (with its process group)
and replaced.

Grading functions are named by import path ("pkg.mod.fn" or "pkg.mod:fn"); workers get the
parent's ``sys.path`` so functions importable in the parent are importable in the worker.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GraderPool", "resolve_callable"]

_BOOT = "from nemo_like.environments.grader_pool import _worker_main; _worker_main()"


def resolve_callable(path: str) -> Callable[..., Any]:
    """Import ``"pkg.mod.fn"`` / ``"pkg.mod:fn"``; clear errors naming the path."""
    if not isinstance(path, str):
        raise TypeError(f"grading function must be an import path string, got {type(path).__name__}")
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"grading function path {path!r} must look like 'pkg.module.function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import grading function {path!r}: {e}") from e
    if not callable(fn):
        raise TypeError(f"grading function {path!r} is a {type(fn).__name__}, not callable")
    return fn


def _worker_main() -> None:
    """Entry point of a worker process: argv = [fn_path, memory_limit_mb, *warm_imports]."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # private result channel...
    os.dup2(2, 1)  # ...so a print() inside a grading function cannot corrupt the protocol
    sys.stdout = sys.stderr
    try:  # die with the parent (a killed Ray actor) instead of lingering: PR_SET_PDEATHSIG = 1
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except Exception:
        pass
    fn_path, memory_mb, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    fn = resolve_callable(fn_path)
    for name in warm:  # import now so the first check's time limit does not pay for it
        module, _, setup = name.partition(":")  # "pkg.mod:fn": also call fn() (an import that needs set-up)
        imported = importlib.import_module(module)
        if setup:
            getattr(imported, setup)()
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        try:
            msg = {"result": float(fn(*json.loads(line)["args"]))}
        except BaseException as e:  # report everything; the parent scores it 0 and counts it
            msg = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(msg) + "\n")


class _Worker:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.job: int | None = None
        self.deadline = 0.0

    def send(self, job: int, args: Sequence[Any], deadline: float) -> bool:
        try:
            self.proc.stdin.write(json.dumps({"args": list(args)}).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError):
            return False
        self.job, self.deadline = job, deadline
        return True

    def read(self) -> list[dict] | None:
        """Complete messages available now; None once the worker has exited."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: grandchildren of a grader too
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass


class GraderPool:
    """``num_workers`` persistent grader processes running ``fn_path`` with a per-call time limit.

    ``run(jobs)`` returns one ``(score, status)`` per job, status "ok", "timeout" or "error"
    (timeouts and errors score 0.0). Workers start lazily on the first ``run`` and are reused.
    ``warm_imports`` are imported by each worker at start-up, outside any time limit (``"pkg.mod:fn"``
    also calls ``fn()``, for an import that needs set-up first).
    """

    def __init__(
        self,
        fn_path: str,
        num_workers: int = 1,
        timeout_s: float = 2.0,
        *,
        memory_limit_mb: int = 2048,
        warm_imports: Sequence[str] = (),
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.fn_path, self.num_workers, self.timeout_s = fn_path, num_workers, timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.argv = [sys.executable, "-c", _BOOT, fn_path, str(int(memory_limit_mb)), *warm_imports]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "OMP_NUM_THREADS": "1",
        }
        self.workers: list[_Worker | None] = [None] * num_workers
        self.last_error: str | None = None

    def _spawn(self, i: int) -> _Worker:
        old = self.workers[i]
        if old is not None:
            old.kill()
        w = _Worker(self.argv, self.env)
        self.workers[i] = w
        return w

    def run(self, jobs: Sequence[Sequence[Any]]) -> list[tuple[float, str]]:
        results: list[tuple[float, str] | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        ws = [w if w is not None and w.proc.poll() is None else self._spawn(i) for i, w in enumerate(self.workers)]

        def finish(job: int, score: float, status: str) -> None:
            results[job] = (score, status)

        def fail_pending(reason: str) -> None:
            self.last_error = reason
            while pending:
                finish(pending.popleft(), 0.0, "error")

        while pending or any(w.job is not None for w in ws):
            now = time.monotonic()
            for i, w in enumerate(ws):
                if w.ready and w.job is None and pending:
                    job = pending.popleft()
                    if not w.send(job, jobs[job], now + self.timeout_s):
                        finish(job, 0.0, "error")
                        ws[i] = self._spawn(i)
            # Block until a result arrives or the earliest deadline (job or start-up) passes.
            deadlines = [w.deadline if w.job is not None else w.started + self.startup_timeout_s
                         for w in ws if w.job is not None or not w.ready]
            wait = max(0.0, min(deadlines) - now) if deadlines else 0.0
            readable = set(select.select([w.fd for w in ws], [], [], wait)[0])
            for i, w in enumerate(ws):
                if w.fd not in readable:
                    continue
                try:
                    msgs = w.read()
                except ValueError:  # malformed line: treat like a crash
                    msgs = None
                if msgs is None:  # the worker exited (crash, OOM kill, failed import)
                    if w.job is not None:
                        finish(w.job, 0.0, "error")
                    elif not w.ready:  # it could not even start: retrying would loop forever
                        fail_pending(f"grader worker for {self.fn_path!r} exited during start-up "
                                     f"(code {w.proc.wait()}); see its stderr")
                    ws[i] = self._spawn(i)
                    continue
                for msg in msgs:
                    if msg.get("ready"):
                        w.ready = True
                    elif w.job is not None:
                        score = msg.get("result")
                        ok = isinstance(score, float) and score == score and abs(score) != float("inf")
                        finish(w.job, score if ok else 0.0, "ok" if ok else "error")
                        if not ok:
                            self.last_error = str(msg.get("error", f"bad result {score!r}"))
                        w.job = None
            now = time.monotonic()
            for i, w in enumerate(ws):
                if w.job is not None and now >= w.deadline:
                    finish(w.job, 0.0, "timeout")
                    ws[i] = self._spawn(i)  # the only way to stop a check stuck in C code
                elif not w.ready and now >= w.started + self.startup_timeout_s:
                    fail_pending(f"grader worker for {self.fn_path!r} not ready after {self.startup_timeout_s}s")
                    ws[i] = self._spawn(i)
        return [r if r is not None else (0.0, "error") for r in results]

    def run_or_fail(self, jobs: Sequence[Sequence[Any]]) -> list[tuple[float, str]]:
        """``run(jobs)`` that never raises: when the pool itself fails (e.g. it cannot fork), every job
        is an "error" scoring 0 and the workers are started afresh on the next call."""
        if not jobs:
            return []
        try:
            return self.run(jobs)
        except Exception:
            self.shutdown()
            return [(0.0, "error")] * len(jobs)

    def shutdown(self) -> None:
        for i, w in enumerate(self.workers):
            if w is not None:
                w.kill()
            self.workers[i] = None

    def __del__(self) -> None:  # an environment dropped without shutdown() leaves no worker behind
        try:
            self.shutdown()
        except Exception:
            pass
