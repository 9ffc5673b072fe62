"""The service process an ``http`` environment starts itself (``env.http.command``): on a free port, its
output in the run's log, dying with the actor that started it, stopped with the environment.

Standard library only (config validation imports the http environment, which imports this).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import threading
from collections import deque
from typing import Any

__all__ = ["free_port", "split_command", "start_service", "stop_service"]


def split_command(command: str | list[str]) -> list[str]:
    """A command line split as a shell would (it is run without one), or a list of arguments as given."""
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(argv: list[str], port: int, output: deque[str]) -> subprocess.Popen:
    """``argv`` ({port} replaced, ``$PORT`` set) started; its output lines go to ``output`` and the log.
    RuntimeError naming the command when it cannot start at all."""
    argv = [a.replace("{port}", str(port)) for a in argv]
    env = dict(os.environ, PORT=str(port))
    started: dict[str, Any] = {}
    ready = threading.Event()

    def keep() -> None:
        # The service is forked from this thread and dies with it (PR_SET_PDEATHSIG), so it lives
        # exactly as long as the service: a killed actor (a restart, the run's end) takes it along.
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    preexec_fn=_die_with_parent)
        except OSError as e:
            proc = e
        started["proc"] = proc
        ready.set()
        if isinstance(proc, OSError):
            return
        assert proc.stdout is not None
        for line in proc.stdout:  # the service's output, in the run's log with the actor's prefix
            output.append(line.rstrip())
            print(f"[http env] {line.rstrip()}", flush=True)
        proc.wait()

    threading.Thread(target=keep, name="http-env-service", daemon=True).start()
    ready.wait()
    if isinstance(started["proc"], OSError):
        raise RuntimeError(f"env.http.command {shlex.join(argv)!r} could not start: {started['proc']}")
    return started["proc"]


def _libc_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:
        return None  # elsewhere the service is stopped by shutdown() and at exit only


# Resolved here, in the parent: the forked child of a threaded actor must not import or load libraries
# between fork and exec (another thread may hold the import lock), only make the call.
_PRCTL = _libc_prctl()


def _die_with_parent() -> None:  # runs in the forked child, before exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)


def stop_service(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 5 s. Idempotent."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
