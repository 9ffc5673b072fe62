"""Run untrusted Python programs (model-written code) in a sandbox, one process per program.

Isolation (the default, "bwrap" mode; needs bubblewrap: ``apt-get install -y bubblewrap``)
--------------------------------------------------------------------------------------------
Every program runs in a fresh ``bwrap`` container:

* **files** (:mod:`~nemo_like.environments.sandbox.mounts`): an allowlist. The root is empty; the
  system directories (``/usr``, ``/etc``, ``/bin``, ``/lib*``), the few files and directories the
  interpreter needs and the config's ``extra_ro_binds`` are mounted read-only; ``/tmp`` (the cwd)
  and ``/dev/shm`` are private tmpfs capped at ``tmp_size_mb`` each (bwrap ``--size``; a bwrap
  without it is refused) and vanish with the run. ``/opt``, ``/srv``, ``/data``, homes, ``/work``,
  the host ``/tmp`` (Ray's sockets), ``/run`` and the rest do not exist in there; the project, the
  model caches, the trainer's cwd and home are masked wherever they fall inside something visible.
* **namespaces**: new network (loopback only: nothing outside, not even the host's localhost, is
  reachable), pid (the program sees only its own processes, so it cannot signal the trainer), ipc,
  uts and cgroup namespaces.
* **syscalls** (:mod:`~nemo_like.environments.sandbox.seccomp`): a seccomp filter refuses new
  user/mount/... namespaces (``unshare``, ``setns``, namespace flags of ``clone``), ``mount`` and
  its kin, keyrings, BPF, ptrace, perf events, io_uring, module loading; ``clone3`` says ENOSYS so
  libc falls back to the filterable ``clone``.
* **environment**: ``PATH``, ``LANG`` and ``HOME`` only; nothing (no secrets) inherited from the trainer.
* **privileges**: as root, bwrap runs privileged (no user namespace) with every capability dropped
  (``--cap-drop ALL``: bwrap keeps them all by default) but the two the trusted prelude needs to
  switch to a *fresh unprivileged uid per run* before any untrusted code (after which it holds
  none). RLIMIT_NPROC is not enforced for root, while for a fresh uid it counts exactly this run's
  processes; the program can read only world-readable files and cannot signal anything outside.
  As a normal user, bwrap runs unprivileged in a new user namespace (RLIMIT_NPROC then counts per
  namespace) with nested user namespaces disabled where bwrap supports it. bwrap always sets
  ``no_new_privs``, so no exec can regain a capability.
* **memory** (:mod:`~nemo_like.environments.sandbox.memory`): ``memory_limit_mb`` caps the run,
  all its processes together: a cgroup v2 ``memory.max`` where the machine delegates one
  (``memory_mode == "cgroup"``), else RLIMIT_AS of ``memory_limit_mb / max_processes`` per process
  with RLIMIT_NPROC = ``max_processes`` (``"rlimit"``).
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
file, network, syscall or process isolation. It exists for machines where bubblewrap cannot be
installed; it warns once. Never point it at a model you do not trust.

Grading protocol
----------------
The trainer sends ``{nonce, program, tests, limits, thread_stack, uid}`` as JSON on stdin to a small
trusted prelude (:data:`_PRELUDE`), which sets the limits, drops privileges, runs ``program`` in a
fresh namespace dict (``__name__ == "__solution__"``, as in HumanEval, so an ``if __name__ ==
"__main__":`` block does not run), then each test snippet in that namespace, each independently.
Results go out on a private channel (the original stderr pipe; the program's stderr goes to stdout)
as lines tagged with a random per-run nonce; a run counts only if the prelude reports reaching the
end ("done"). Exiting early (``sys.exit``, ``os._exit``), crashing or exceeding a limit therefore
scores 0.

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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nemo_like.environments.sandbox.config import (
    BWRAP_INSTALL_HINT,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
)
from nemo_like.environments.sandbox.memory import THREAD_STACK_BYTES, RunCgroup, find_cgroup_parent
from nemo_like.environments.sandbox.mounts import SAFE_ENV, filesystem_args, probe_interpreter, sensitive_dirs
from nemo_like.environments.sandbox.prelude import PRELUDE as _PRELUDE
from nemo_like.environments.sandbox.run import RunState, communicate, interpret, kill_run
from nemo_like.environments.sandbox.seccomp import UnsupportedArchError, seccomp_filter

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
# bwrap options the sandbox cannot do without: --size caps the tmpfs mounts (their pages are RAM)
_REQUIRED_BWRAP_OPTIONS = ("--size", "--seccomp", "--info-fd", "--die-with-parent", "--clearenv")

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


def _default_python() -> str:
    """The real interpreter behind this process (through venv symlinks): it runs isolated (-I -S)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def _bwrap_help(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env=SAFE_ENV)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout + out.stderr if out.returncode == 0 else ""


# ------------------------------------------------------------------------------------ sandbox
class Sandbox:
    """Runs programs (plus optional test snippets) under :class:`SandboxConfig`'s limits.

    Thread-safe: at most ``config.max_concurrency`` runs execute at once, whichever threads call
    :meth:`run`. Construction checks that the sandbox really works (one tiny run) and raises
    :class:`SandboxUnavailableError` with the reason if not, unless ``allow_unsandboxed``.
    ``mode`` is "bwrap" or "unsandboxed"; ``memory_mode`` is "cgroup", "rlimit" or "none" (see
    :mod:`~nemo_like.environments.sandbox.memory`), ``memory_mode_reason`` says why.
    """

    def __init__(self, config: SandboxConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SandboxConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, SandboxConfig):
            raise TypeError(f"Sandbox config must be a SandboxConfig, got {type(config).__name__}")
        self.config = config
        self.python = os.path.realpath(config.python_executable or _default_python())
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self._active_lock = threading.Lock()
        self._active = 0
        self.peak_concurrency = 0  # most runs seen executing at once (for monitoring and tests)
        self._is_root = os.geteuid() == 0
        self._cgroup_parent: str | None = None
        if config.memory_limit_mb == 0:
            self.memory_mode, self.memory_mode_reason = "none", "memory_limit_mb is 0"
        else:
            try:
                self._cgroup_parent, why = find_cgroup_parent(config.cgroup_parent)
            except ValueError as e:  # a configured cgroup_parent that does not work
                raise SandboxUnavailableError(str(e)) from None
            self.memory_mode = "cgroup" if self._cgroup_parent else "rlimit"
            self.memory_mode_reason = why
        self.mode = "bwrap"
        self._bwrap_argv_head: list[str] = []
        self._seccomp = b""
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
            if self._is_root and self.memory_mode == "rlimit":
                # no fresh uid without bwrap, and RLIMIT_NPROC does not bind root
                self.memory_mode_reason += "; unsandboxed as root, processes are not counted: the cap holds per process only"
            if not os.access(self.python, os.X_OK):
                raise SandboxUnavailableError(f"the sandbox interpreter {self.python!r} is not executable")
        logger.info(
            "code sandbox: %s, memory cap per run: %s (%s)", self.mode, self.memory_mode, self.memory_mode_reason
        )

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
        usage = _bwrap_help(bwrap)
        if "--ro-bind" not in usage:
            return f"bubblewrap at {bwrap!r} does not work here: `{bwrap} --help` failed"
        missing = [opt for opt in _REQUIRED_BWRAP_OPTIONS if opt not in usage]
        if missing:
            return (
                f"bubblewrap at {bwrap!r} is too old: it lacks {', '.join(missing)} (--size is how the sandbox "
                "caps its RAM-backed /tmp and /dev/shm; --seccomp how it forbids namespaces and mounts)"
            )
        try:
            self._seccomp = seccomp_filter()
            view = probe_interpreter(self.python)
        except (UnsupportedArchError, RuntimeError) as e:
            return str(e)
        argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if self._is_root:
            # privileged bwrap without a user namespace keeps ALL of root's capabilities unless told
            # otherwise: keep only the two the prelude needs to switch to the run's uid (after which
            # it holds none, and no_new_privs stops any exec from regaining some)
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-user"] + (["--disable-userns"] if "--disable-userns" in usage else [])
        argv += ["--die-with-parent", "--new-session"]
        argv += filesystem_args(view, cfg.extra_ro_binds, sensitive_dirs(cfg.hidden_paths), cfg.tmp_size_mb << 20)
        argv += ["--chdir", "/tmp", "--clearenv"]
        for k, v in {**SAFE_ENV, "HOME": "/tmp"}.items():
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
        payload = json.dumps({
            "nonce": nonce, "program": program, "tests": tests, "limits": cfg.limits(timeout, self.memory_mode),
            "thread_stack": THREAD_STACK_BYTES if self.memory_mode == "rlimit" else 0, "uid": uid,
        }).encode()
        env = {**SAFE_ENV, "HOME": "/tmp"}
        workdir = None
        pipes: list[int] = []  # fds of this process to close once the run has started
        info_r = -1
        argv = self._argv()
        cgroup = None
        try:
            if self._cgroup_parent is not None:
                cgroup = RunCgroup(self._cgroup_parent, cfg.run_memory_bytes())
            if self.mode == "bwrap":
                # bwrap reports the pid of the container's init on this pipe; killing that init
                # takes down every process in the container, and its exit means they are all gone
                info_r, info_w = os.pipe()
                # ... and reads the seccomp filter from this one (~400 bytes: fits the pipe buffer)
                seccomp_r, seccomp_w = os.pipe()
                pipes += [info_w, seccomp_r, seccomp_w]
                os.write(seccomp_w, self._seccomp)
                os.close(pipes.pop())
                argv = [argv[0], "--info-fd", str(info_w), "--seccomp", str(seccomp_r), *argv[1:]]
            else:
                workdir = tempfile.mkdtemp(prefix="nemo_like_sbx_")
                env["HOME"] = env["TMPDIR"] = workdir
            if cgroup is not None:
                argv = cgroup.launcher() + argv
            start = time.monotonic()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=workdir or "/",
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(pipes),
            )
        except OSError as e:
            for fd in [*pipes, info_r]:
                if fd >= 0:
                    os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            if cgroup is not None:
                cgroup.remove()
            return SandboxResult("sandbox_error", [False] * len(tests), error=f"cannot start the sandbox: {e}")
        for fd in pipes:
            os.close(fd)
        state = RunState()
        try:
            communicate(proc, payload, start + timeout, len(tests), info_r, state, cfg.max_output_bytes)
        finally:
            if cgroup is not None:
                cgroup.kill_all()
            kill_run(proc, state)
            for fd in (info_r, state.init_pidfd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        duration = time.monotonic() - start
        result = interpret(nonce, state, proc.returncode, len(tests), duration, cfg.max_output_bytes)
        if cgroup is not None:
            if result.status in ("crashed", "sandbox_error") and cgroup.oom_killed():
                result.error = f"killed: the run went over its memory cap ({cfg.run_memory_bytes() >> 20} MiB)"
            cgroup.remove()
        return result


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
