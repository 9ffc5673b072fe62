"""The sandbox's limits (:class:`SandboxConfig`), the outcome of a run (:class:`SandboxResult`) and
what a :class:`~nemo_like.environments.sandbox.Sandbox` needs to know about the host: the interpreter
to run, its directories, the bwrap version, the directories to hide from programs and how a run's
processes exited."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

BWRAP_INSTALL_HINT = "install bubblewrap, e.g. `apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"

# Statuses of a run. Only "ok" means the prelude ran every test; everything else scores 0.
STATUSES = ("ok", "program_error", "crashed", "timeout", "output_limit", "sandbox_error")


_SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_DEFAULT_HIDDEN = ("/root", "/home", "/work", "/run", "/var/tmp", "/mnt", "/media", "/srv")


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or unusable here and the config does not allow the unsandboxed mode."""


# ------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and mode of a :class:`Sandbox`. All sizes are per run.

    timeout_s: wall-clock limit of one run (startup included). cpu_time_s: RLIMIT_CPU (None:
    ``ceil(timeout_s) + 1``). memory_limit_mb: RLIMIT_AS (0: none). max_processes: RLIMIT_NPROC
    (processes and threads). max_file_size_mb: RLIMIT_FSIZE. max_open_files: RLIMIT_NOFILE.
    max_output_bytes: stdout+stderr cap (more kills the run). tmp_size_mb: size of the private
    ``/tmp`` and ``/dev/shm`` (bwrap >= 0.7). max_concurrency: runs at once in one Sandbox.
    bwrap_path: the bwrap binary (None: ``bwrap`` on PATH). python_executable: the interpreter (None:
    the real base interpreter behind ``sys.executable``; it runs with ``-I -S -B``, so the project's
    venv is not needed). hidden_paths: more host directories to hide. allow_unsandboxed: fall back
    to the rlimit-only mode (warned once) when bwrap is missing or unusable, instead of raising.
    """

    timeout_s: float = 5.0
    cpu_time_s: float | None = None
    memory_limit_mb: int = 512
    max_processes: int = 16
    max_file_size_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    tmp_size_mb: int = 64
    max_concurrency: int = 2
    bwrap_path: str | None = None
    python_executable: str | None = None
    hidden_paths: tuple[str, ...] = ()
    allow_unsandboxed: bool = False

    def __post_init__(self) -> None:
        def positive_number(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"SandboxConfig.{name} must be a positive number, got {value!r}")

        def int_at_least(name: str, value: Any, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SandboxConfig.{name} must be an int >= {low}, got {value!r}")

        positive_number("timeout_s", self.timeout_s)
        if self.cpu_time_s is not None:
            positive_number("cpu_time_s", self.cpu_time_s)
        int_at_least("memory_limit_mb", self.memory_limit_mb, 0)
        int_at_least("max_processes", self.max_processes, 1)
        int_at_least("max_file_size_mb", self.max_file_size_mb, 1)
        int_at_least("max_open_files", self.max_open_files, 16)
        int_at_least("max_output_bytes", self.max_output_bytes, 1)
        int_at_least("tmp_size_mb", self.tmp_size_mb, 1)
        int_at_least("max_concurrency", self.max_concurrency, 1)
        for name in ("bwrap_path", "python_executable"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SandboxConfig.{name} must be a non-empty string or None, got {value!r}")
        if isinstance(self.hidden_paths, str) or not all(
            isinstance(p, str) and os.path.isabs(p) for p in self.hidden_paths
        ):
            raise ValueError(f"SandboxConfig.hidden_paths must be absolute path strings, got {self.hidden_paths!r}")
        object.__setattr__(self, "hidden_paths", tuple(self.hidden_paths))
        if not isinstance(self.allow_unsandboxed, bool):
            raise ValueError(f"SandboxConfig.allow_unsandboxed must be a bool, got {self.allow_unsandboxed!r}")

    def limits(self, timeout_s: float) -> list[tuple[str, int]]:
        """(rlimit name, value) pairs the prelude applies."""
        cpu = self.cpu_time_s if self.cpu_time_s is not None else math.ceil(timeout_s) + 1
        out = [
            ("RLIMIT_CPU", max(1, math.ceil(cpu))),
            ("RLIMIT_NPROC", self.max_processes),
            ("RLIMIT_FSIZE", self.max_file_size_mb << 20),
            ("RLIMIT_NOFILE", self.max_open_files),
            ("RLIMIT_CORE", 0),
        ]
        if self.memory_limit_mb:
            out.append(("RLIMIT_AS", self.memory_limit_mb << 20))
        return out


@dataclasses.dataclass
class SandboxResult:
    """Outcome of one run.

    status: "ok" (the prelude ran every test; individual tests may still have failed),
    "program_error" (the program raised, incl. SyntaxError/SystemExit/MemoryError),
    "crashed" (exited without finishing: os._exit, a signal, a CPU/file-size limit),
    "timeout", "output_limit", or "sandbox_error" (the sandbox itself failed to start).
    """

    status: str
    tests_passed: list[bool]
    output: str = ""  # the program's stdout+stderr, at most max_output_bytes
    returncode: int | None = None
    duration_s: float = 0.0
    error: str = ""  # what went wrong: the exception, the signal, bwrap's message...
    test_errors: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def num_passed(self) -> int:
        return sum(self.tests_passed) if self.status == "ok" else 0

    @property
    def pass_fraction(self) -> float:
        """Fraction of tests passed; 0.0 unless status is "ok" or when there are no tests."""
        n = len(self.tests_passed)
        return self.num_passed / n if n and self.status == "ok" else 0.0

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and bool(self.tests_passed) and all(self.tests_passed)


# ------------------------------------------------------------------------------------ helpers
def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10, env=_SAFE_ENV)
    except (OSError, subprocess.SubprocessError):
        return (0,)
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout + out.stderr)
    return tuple(int(g or 0) for g in m.groups()) if m else (0,)


def _default_python() -> str:
    """The real interpreter behind this process (through venv symlinks): it runs isolated (-I -S)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def _interpreter_dirs(python: str) -> list[str]:
    """Directories the interpreter needs: its prefixes and the directory of its binary."""
    code = "import sys; print(sys.base_prefix); print(sys.base_exec_prefix); print(sys.executable)"
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30, env=_SAFE_ENV, cwd="/"
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailableError(f"cannot run the sandbox interpreter {python!r}: {e}") from e
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 3:
        raise SandboxUnavailableError(
            f"the sandbox interpreter {python!r} does not work (exit {out.returncode}): {out.stderr.strip()[:500]}"
        )
    dirs = [os.path.realpath(lines[0]), os.path.realpath(lines[1]), os.path.dirname(os.path.realpath(python))]
    return _dedupe_nested(dirs)


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _dedupe_nested(paths: Sequence[str]) -> list[str]:
    """Drop duplicates and paths inside another path of the list (shortest first)."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths}, key=len):
        if p != "/" and not any(_is_within(p, q) for q in out):
            out.append(p)
    return out


def _project_root() -> str:
    # nemo_like/environments/sandbox_config.py -> the directory holding the nemo_like package
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _hidden_roots(extra: Sequence[str]) -> list[str]:
    candidates = list(_DEFAULT_HIDDEN) + list(extra) + [_project_root(), tempfile.gettempdir()]
    for getter in (os.getcwd, lambda: os.path.expanduser("~")):
        try:
            candidates.append(getter())
        except OSError:
            pass
    real = []
    for p in candidates:
        try:
            rp = os.path.realpath(p)
        except OSError:
            continue
        # /tmp and /dev get their own private mounts; / itself cannot be hidden
        if rp in ("/", "/tmp", "/dev", "/proc") or _is_within(rp, "/dev") or _is_within(rp, "/proc"):
            continue
        if _is_within(rp, "/tmp"):
            continue  # under the private /tmp already
        if os.path.isdir(rp):
            real.append(rp)
    return _dedupe_nested(real)


def _open_init_pidfd(info: bytes) -> int | None:
    """pidfd of the container init named in bwrap's --info-fd JSON ({"child-pid": N, ...})."""
    try:
        pid = json.loads(bytes(info).decode())["child-pid"]
        return os.pidfd_open(int(pid)) if isinstance(pid, int) and pid > 1 else None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return None


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its pid and pgid stay reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode} before finishing"
