"""Run untrusted Python programs (model-written code) in a sandbox, one process per program.

Isolation (the default, "bwrap" mode; needs bubblewrap: ``apt-get install -y bubblewrap``)
--------------------------------------------------------------------------------------------
Every program runs in a fresh ``bwrap`` container:

* **files**: the host root is mounted read-only; ``/tmp`` (the cwd) and ``/dev/shm`` are private,
  size-capped tmpfs that vanish with the run; the homes (``/root``, ``/home``), ``/work``, ``/run``
  (docker secrets), ``/var/tmp``, ``/mnt``, ``/media``, ``/srv``, the project directory, the
  trainer's cwd and temp dir are hidden behind empty tmpfs. Only the interpreter's own install is
  bound back (read-only) when it lives under a hidden directory.
* **namespaces**: new network (loopback only: nothing outside, not even the host's localhost, is
  reachable), pid (the program sees only its own processes, so it cannot signal the trainer), ipc,
  uts and cgroup namespaces.
* **environment**: ``PATH``, ``LANG`` and ``HOME`` only; nothing (no secrets) inherited from the trainer.
* **privileges**: as root, bwrap runs privileged (no user namespace) and the trusted prelude drops to
  a *fresh unprivileged uid per run* before any untrusted code: RLIMIT_NPROC is not enforced for
  root, while for a fresh uid it counts exactly this run's processes; the program can then read only
  world-readable files and cannot signal anything outside. As a normal user, bwrap runs unprivileged
  in a new user namespace (RLIMIT_NPROC then counts per namespace) with nested user namespaces
  disabled where bwrap supports it. bwrap always sets ``no_new_privs``.
* **rlimits** (set by the prelude before untrusted code): CPU seconds, address space, processes,
  file size, open files, no core dumps.
* **wall clock**: each run is its own process group (``start_new_session``); on timeout the group is
  SIGKILLed, and ``--die-with-parent`` plus the pid namespace take every process in the container
  with it.
* **output**: stdout+stderr are read with a cap; a program that prints more than
  ``max_output_bytes`` is killed at once (status ``output_limit``), so a program printing gigabytes
  costs neither memory nor time.

Unsandboxed mode (``allow_unsandboxed=True`` and no usable bwrap) runs the same prelude directly with
the rlimits, a clean environment, a fresh temp dir as cwd and the process-group kill, but with NO
file, network or process isolation. It exists for machines where bubblewrap cannot be installed;
it warns once. Never point it at a model you do not trust.

Grading protocol
----------------
The trainer sends ``{nonce, program, tests, limits, uid}`` as JSON on stdin to a small trusted
prelude (:data:`_PRELUDE`), which sets the limits, drops privileges, runs ``program`` in a fresh
namespace dict (``__name__ == "__solution__"``, as in HumanEval, so an ``if __name__ == "__main__":``
block does not run), then each test snippet in that namespace, each independently. Results go out on
a private channel (the original stderr pipe; the program's stderr goes to stdout) as lines tagged
with a random per-run nonce; a run counts only if the prelude reports reaching the end ("done").
Exiting early (``sys.exit``, ``os._exit``), crashing or exceeding a limit therefore scores 0.

Limitation: the program and its tests share one interpreter, so a program written to attack the
harness itself (e.g. walking the garbage collector to find the nonce, or returning objects whose
``__eq__`` always says True) could forge passes. The sandbox protects the host, not the reward against
a deliberately adversarial program; this is the same trust model as HumanEval's own harness.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nemo_like.environments.sandbox_prelude import PRELUDE as _PRELUDE
from nemo_like.environments.sandbox_prelude import RESULT_LINE_CAP as _RESULT_LINE_CAP
from nemo_like.environments.sandbox_config import (
    _describe_exit,
    _exited,
    _open_init_pidfd,
    _SAFE_ENV,
    BWRAP_INSTALL_HINT,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    _bwrap_version,
    _default_python,
    _hidden_roots,
    _interpreter_dirs,
    _is_within,
)

__all__ = [
    "SandboxConfig",
    "SandboxResult",
    "Sandbox",
    "SandboxUnavailableError",
    "run_many",
    "BWRAP_INSTALL_HINT",
]

logger = logging.getLogger(__name__)

# When the trainer is root, each run gets a fresh uid from this range (above systemd's container
# ranges, below 2**31): RLIMIT_NPROC then counts only that run's processes.
_UID_BASE, _UID_SPAN = 2_000_000_000, 100_000_000

_warned_unsandboxed = False
_warn_lock = threading.Lock()


def _warn_unsandboxed_once(reason: str) -> None:
    global _warned_unsandboxed
    with _warn_lock:
        if _warned_unsandboxed:
            return
        _warned_unsandboxed = True
    msg = (
        f"nemo_like sandbox: {reason}; running model-written programs WITHOUT isolation "
        "(rlimits and a clean environment only: they can read your files, reach the network and signal "
        f"your processes) because allow_unsandboxed is true. To isolate them, {BWRAP_INSTALL_HINT}."
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    logger.warning(msg)


# ------------------------------------------------------------------------------------ sandbox
class Sandbox:
    """Runs programs (plus optional test snippets) under :class:`SandboxConfig`'s limits.

    Thread-safe: at most ``config.max_concurrency`` runs execute at once, whichever threads call
    :meth:`run`. Construction checks that the sandbox really works (one tiny run) and raises
    :class:`SandboxUnavailableError` with the reason if not, unless ``allow_unsandboxed``.
    """

    def __init__(self, config: SandboxConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SandboxConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, SandboxConfig):
            raise TypeError(f"Sandbox config must be a SandboxConfig, got {type(config).__name__}")
        self.config = config
        self.python = config.python_executable or _default_python()
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self._active_lock = threading.Lock()
        self._active = 0
        self.peak_concurrency = 0  # most runs seen executing at once (for monitoring and tests)
        self._is_root = os.geteuid() == 0
        self.mode = "bwrap"
        self._bwrap_argv_head: list[str] = []
        reason = self._setup_bwrap()
        if reason is not None:
            if not config.allow_unsandboxed:
                raise SandboxUnavailableError(
                    f"{reason}. The code sandbox needs bubblewrap: {BWRAP_INSTALL_HINT}; or set "
                    "allow_unsandboxed: true to run programs with rlimits only (NOT isolated; only for "
                    "code you trust)."
                )
            _warn_unsandboxed_once(reason)
            self.mode = "unsandboxed"
            if not os.access(self.python, os.X_OK):
                raise SandboxUnavailableError(f"the sandbox interpreter {self.python!r} is not executable")

    # -------------------------------------------------------------------------- bwrap setup
    def _setup_bwrap(self) -> str | None:
        """Build the bwrap command prefix and self-test it; returns why bwrap cannot be used, or None."""
        cfg = self.config
        if cfg.bwrap_path is not None:
            bwrap = cfg.bwrap_path
            if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
                return f"bubblewrap not found: bwrap_path {bwrap!r} is not an executable file"
        else:
            bwrap = shutil.which("bwrap") or ""
            if not bwrap:
                return "bubblewrap (`bwrap`) is not installed (not found on PATH)"
        version = _bwrap_version(bwrap)
        try:
            interpreter_dirs = _interpreter_dirs(self.python)
        except SandboxUnavailableError as e:
            return str(e)
        hidden = _hidden_roots(cfg.hidden_paths)
        size = ["--size", str(cfg.tmp_size_mb << 20)] if version >= (0, 7) else []
        argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if self._is_root:
            # privileged bwrap without a user namespace; the prelude needs these two to drop to the
            # run's uid (after which it holds no capabilities at all)
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-user"] + (["--disable-userns"] if version >= (0, 8) else [])
        argv += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        argv += ["--perms", "1777", *size, "--tmpfs", "/tmp", "--perms", "1777", *size, "--tmpfs", "/dev/shm"]
        # hidden dirs containing the interpreter are mounted first, the interpreter is bound back
        # into them, and hidden dirs inside the interpreter's install (odd, but possible) come last
        hidden = [h for h in hidden if h not in interpreter_dirs]
        outer = [h for h in hidden if not any(_is_within(h, d) for d in interpreter_dirs)]
        inner = [h for h in hidden if h not in outer]
        for h in outer:
            argv += ["--tmpfs", h]
        made: set[str] = set()
        for d in interpreter_dirs:
            roots = [h for h in ["/tmp", *outer] if _is_within(d, h) and h != d]
            if not roots:
                continue  # visible through the read-only root already
            # recreate the path's directories world-traversable (bwrap would make them 0700,
            # which the dropped uid could not enter), then bind the install back read-only
            root = max(roots, key=len)
            rel = os.path.relpath(d, root).split(os.sep)
            cur = root
            for part in rel[:-1]:
                cur = os.path.join(cur, part)
                if cur not in made:
                    made.add(cur)
                    argv += ["--perms", "0755", "--dir", cur]
            argv += ["--ro-bind", d, d]
        for h in inner:
            argv += ["--tmpfs", h]
        for h in outer + inner:  # empty and read-only: no writing to (RAM-backed) hidden dirs either
            argv += ["--remount-ro", h]
        argv += ["--chdir", "/tmp"]
        if version >= (0, 6):
            argv += ["--clearenv"]
        for k, v in {**_SAFE_ENV, "HOME": "/tmp"}.items():
            argv += ["--setenv", k, v]
        self._bwrap_argv_head = argv
        # self-test: a real run, which imports a module after the privilege drop
        probe = self._run_one("import fractions\nx = fractions.Fraction(1, 2)\n", ["assert x * 2 == 1"], 30.0)
        if probe.status != "ok" or probe.tests_passed != [True]:
            detail = probe.error or probe.output
            hint = ""
            if "uid map" in detail or "setting up uid" in detail or "Operation not permitted" in detail:
                hint = " (unprivileged user namespaces may be disabled here; run as root or enable them)"
            elif "Permission denied" in detail or "No module named" in detail:
                hint = " (the interpreter must be readable by an unprivileged user; set python_executable, e.g. /usr/bin/python3)"
            return f"bubblewrap at {bwrap!r} does not work here: {probe.status}: {detail.strip()[:600]}{hint}"
        return None

    def _argv(self) -> list[str]:
        tail = [self.python, "-I", "-S", "-B", "-c", _PRELUDE]
        return self._bwrap_argv_head + tail if self.mode == "bwrap" else tail

    # -------------------------------------------------------------------------- running
    def run(self, program: str, tests: Sequence[str] = (), *, timeout_s: float | None = None) -> SandboxResult:
        """Run ``program`` then each test snippet in its namespace. Blocks for a free slot first.

        Never raises for anything the program does; an OS failure to start the run (e.g. no pids
        left) comes back as status "sandbox_error".
        """
        if not isinstance(program, str):
            raise TypeError(f"program must be a str, got {type(program).__name__}")
        tests = list(tests)
        if not all(isinstance(t, str) for t in tests):
            raise TypeError("tests must be strings")
        timeout = self.config.timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        with self._slots:
            with self._active_lock:
                self._active += 1
                self.peak_concurrency = max(self.peak_concurrency, self._active)
            try:
                return self._run_one(program, tests, timeout)
            finally:
                with self._active_lock:
                    self._active -= 1

    def run_many(
        self,
        jobs: Sequence[tuple[str, Sequence[str]]],
        *,
        max_concurrency: int | None = None,
        timeout_s: float | None = None,
    ) -> list[SandboxResult]:
        """Run ``(program, tests)`` jobs concurrently, at most ``max_concurrency`` at once (and never more
        than ``config.max_concurrency``); results in job order."""
        jobs = list(jobs)
        if not jobs:
            return []
        n = self.config.max_concurrency if max_concurrency is None else max_concurrency
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        n = min(n, self.config.max_concurrency, len(jobs))

        def one(job: tuple[str, Sequence[str]]) -> SandboxResult:
            try:
                program, tests = job
                return self.run(program, tests, timeout_s=timeout_s)
            except Exception as e:  # a bad job (not strings) must not sink its batch
                n_tests = _safe_len(job[1]) if isinstance(job, tuple) and len(job) == 2 else 0
                return SandboxResult("sandbox_error", [False] * n_tests, error=f"{type(e).__name__}: {e}")

        if n == 1:
            return [one(j) for j in jobs]
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sandbox") as pool:
            return list(pool.map(one, jobs))

    def _run_one(self, program: str, tests: list[str], timeout: float) -> SandboxResult:
        cfg = self.config
        nonce = secrets.token_hex(16)
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if (self._is_root and self.mode == "bwrap") else None
        payload = json.dumps(
            {"nonce": nonce, "program": program, "tests": tests, "limits": cfg.limits(timeout), "uid": uid}
        ).encode()
        env = {**_SAFE_ENV, "HOME": "/tmp"}
        workdir = None
        info_r = info_w = -1
        argv = self._argv()
        if self.mode == "bwrap":
            # bwrap reports the pid of the container's init on this pipe; killing that init takes
            # down every process in the container, and its exit means they are all gone
            info_r, info_w = os.pipe()
            argv = [argv[0], "--info-fd", str(info_w), *argv[1:]]
        else:
            workdir = tempfile.mkdtemp(prefix="nemo_like_sbx_")
            env["HOME"] = env["TMPDIR"] = workdir
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=workdir or "/",
                start_new_session=True,
                close_fds=True,
                pass_fds=(info_w,) if info_w >= 0 else (),
            )
        except OSError as e:
            for fd in (info_r, info_w):
                if fd >= 0:
                    os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            return SandboxResult("sandbox_error", [False] * len(tests), error=f"cannot start the sandbox: {e}")
        if info_w >= 0:
            os.close(info_w)
        state = _RunState()
        try:
            self._communicate(proc, payload, start + timeout, len(tests), info_r, state)
        finally:
            self._kill(proc, state)
            for fd in (info_r, state.init_pidfd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        duration = time.monotonic() - start
        return self._interpret(nonce, state, proc.returncode, len(tests), duration)

    @staticmethod
    def _kill(proc: subprocess.Popen, state: _RunState) -> None:
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

    def _communicate(
        self, proc: subprocess.Popen, payload: bytes, deadline: float, n_tests: int, info_fd: int, state: _RunState
    ) -> None:
        """Feed stdin and read the pipes with caps until the process exits or the deadline passes.

        Fills ``state``: program output, result channel, output_limit / timed_out flags and a pidfd of
        the container's init. Never blocks past the deadline: all pipes are non-blocking and the
        process exit is watched through a pidfd (polling waitid without reaping where pidfds are
        unavailable).
        """
        out_cap = self.config.max_output_bytes
        res_cap = 4096 + _RESULT_LINE_CAP * (n_tests + 4)
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
                if exited_at is None and pidfd is None and _exited(proc.pid):
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
                                state.init_pidfd = _open_init_pidfd(info)
                            continue
                        if what == "info":
                            info += chunk[: max(0, 4096 - len(info))]
                            if state.init_pidfd is None and b"}" in info:
                                state.init_pidfd = _open_init_pidfd(info)
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

    def _interpret(self, nonce: str, state: _RunState, returncode: int | None, n_tests: int, duration: float) -> SandboxResult:
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
            status, error = "output_limit", f"output exceeded {self.config.max_output_bytes} bytes"
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
            error = _describe_exit(returncode)
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


@dataclasses.dataclass
class _RunState:
    out: bytearray = dataclasses.field(default_factory=bytearray)  # the program's stdout+stderr
    res: bytearray = dataclasses.field(default_factory=bytearray)  # the prelude's result lines
    output_limit: bool = False
    timed_out: bool = False
    init_pidfd: int | None = None  # the bwrap container's init (pid 1 of its pid namespace)


def _safe_len(x: Any) -> int:
    try:
        return len(x)
    except Exception:
        return 0


def run_many(
    jobs: Sequence[tuple[str, Sequence[str]]],
    *,
    max_concurrency: int = 2,
    sandbox: Sandbox | None = None,
    **config: Any,
) -> list[SandboxResult]:
    """Run ``(program, tests)`` jobs with at most ``max_concurrency`` at once.

    Uses ``sandbox`` or a new :class:`Sandbox` built from ``config`` (keyword arguments of
    :class:`SandboxConfig`).
    """
    if sandbox is None:
        config.setdefault("max_concurrency", max_concurrency)
        sandbox = Sandbox(SandboxConfig(**config))
    return sandbox.run_many(jobs, max_concurrency=max_concurrency)
