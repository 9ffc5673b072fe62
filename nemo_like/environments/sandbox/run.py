"""One sandboxed run's process plumbing: feeding and reading its pipes with caps and a deadline,
killing everything it started, and turning what came back into a :class:`SandboxResult`."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import time

from nemo_like.environments.sandbox.config import SandboxResult
from nemo_like.environments.sandbox.prelude import RESULT_LINE_CAP

__all__ = ["RunState", "communicate", "kill_run", "interpret"]


@dataclasses.dataclass
class RunState:
    out: bytearray = dataclasses.field(default_factory=bytearray)  # the program's stdout+stderr
    res: bytearray = dataclasses.field(default_factory=bytearray)  # the prelude's result lines
    output_limit: bool = False
    timed_out: bool = False
    init_pidfd: int | None = None  # the bwrap container's init (pid 1 of its pid namespace)


def kill_run(proc: subprocess.Popen, state: RunState) -> None:
    """Kill everything the run started and wait until it is gone (bounded)."""
    if state.init_pidfd is not None:
        try:
            signal.pidfd_send_signal(state.init_pidfd, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    try:  # the whole group, *before* reaping, so the pgid cannot have been reused
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()  # type: ignore[union-attr]
        except Exception:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the OS
        pass
    if state.init_pidfd is not None:
        # the container's init exits only after every process of its pid namespace is dead
        try:
            waiter = selectors.DefaultSelector()
            waiter.register(state.init_pidfd, selectors.EVENT_READ)
            waiter.select(10)
            waiter.close()
        except (OSError, ValueError):
            pass


def communicate(
    proc: subprocess.Popen, payload: bytes, deadline: float, n_tests: int, info_fd: int, state: RunState, out_cap: int
) -> None:
    """Feed stdin and read the pipes with caps until the process exits or the deadline passes.

    Fills ``state``: program output, result channel, output_limit / timed_out flags and a pidfd of
    the container's init. Never blocks past the deadline: all pipes are non-blocking and the
    process exit is watched through a pidfd (polling waitid without reaping where pidfds are
    unavailable).
    """
    res_cap = 4096 + RESULT_LINE_CAP * (n_tests + 4)
    info = bytearray()
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    for fd in (proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()):
        os.set_blocking(fd, False)
    view = memoryview(payload)
    if view:
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "res")
    if info_fd >= 0:
        sel.register(info_fd, selectors.EVENT_READ, "info")
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (AttributeError, OSError):
        pidfd = None
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and pidfd is None and exited(proc.pid):
                exited_at = now
            open_pipes = any(k.data in ("out", "res") for k in sel.get_map().values())
            if exited_at is not None and (not open_pipes or now - exited_at > 0.25):
                return  # exited (stragglers get 0.25 s to flush)
            if now >= deadline:
                state.timed_out = True
                return
            wait = deadline - now
            if pidfd is None:
                wait = min(wait, 0.02)
            if exited_at is not None:
                wait = min(wait, 0.05)
            for key, _ in sel.select(wait):
                what = key.data
                if what == "exit":
                    sel.unregister(key.fd)
                    exited_at = time.monotonic()
                elif what == "in":
                    try:
                        written = os.write(key.fd, view[:65536])
                        view = view[written:]
                    except BlockingIOError:
                        continue
                    except OSError:  # the sandbox died before reading everything
                        view = view[:0]
                    if not view:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                else:
                    try:
                        chunk = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fd)
                        if what == "info" and state.init_pidfd is None:
                            state.init_pidfd = open_init_pidfd(info)
                        continue
                    if what == "info":
                        info += chunk[: max(0, 4096 - len(info))]
                        if state.init_pidfd is None and b"}" in info:
                            state.init_pidfd = open_init_pidfd(info)
                        continue
                    buf, cap = (state.out, out_cap) if what == "out" else (state.res, res_cap)
                    room = cap - len(buf)
                    buf += chunk[: max(room, 0)]
                    if len(chunk) > room:
                        state.output_limit = True
                        return
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)


def interpret(
    nonce: str, state: RunState, returncode: int | None, n_tests: int, duration: float, out_cap: int
) -> SandboxResult:
    out, res, timed_out = bytes(state.out), bytes(state.res), state.timed_out
    tag = nonce.encode()
    events: list[tuple[str, int, str]] = []
    other: list[str] = []
    for line in res.splitlines():
        parts = line.split(b" ", 3)
        if len(parts) >= 3 and parts[0] == tag:
            try:
                index = int(parts[2])
            except ValueError:
                continue
            info = parts[3].decode("utf-8", "replace") if len(parts) > 3 else ""
            events.append((parts[1].decode("ascii", "replace"), index, info))
        elif line.strip():
            other.append(line.decode("utf-8", "replace"))
    kinds = {k for k, _, _ in events}
    passed = [False] * n_tests
    test_errors: dict[int, str] = {}
    for kind, index, info in events:
        if 0 <= index < n_tests:
            if kind == "pass":
                passed[index] = True
            elif kind == "fail":
                test_errors[index] = info
    text = out.decode("utf-8", "replace")
    error = ""
    if state.output_limit:
        status, error = "output_limit", f"output exceeded {out_cap} bytes"
    elif "done" in kinds:
        status = "ok"
    elif timed_out:
        status, error = "timeout", "wall-clock limit exceeded"
    elif "ready" not in kinds:
        status, error = "sandbox_error", "\n".join(other)[-2000:] or f"sandbox exited with {returncode}"
    elif "program_error" in kinds:
        status = "program_error"
        error = next(info for kind, _, info in events if kind == "program_error")
    else:
        status = "crashed"
        error = describe_exit(returncode)
    if status != "ok":
        passed = [False] * n_tests
    return SandboxResult(
        status=status,
        tests_passed=passed,
        output=text,
        returncode=returncode,
        duration_s=duration,
        error=error,
        test_errors=test_errors,
    )


def open_init_pidfd(info: bytes) -> int | None:
    """pidfd of the container init named in bwrap's --info-fd JSON ({"child-pid": N, ...})."""
    try:
        pid = json.loads(bytes(info).decode())["child-pid"]
        return os.pidfd_open(int(pid)) if isinstance(pid, int) and pid > 1 else None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return None


def exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its pid and pgid stay reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode} before finishing"
