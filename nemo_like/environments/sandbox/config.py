"""The sandbox's limits and isolation options (:class:`SandboxConfig`) and the outcome of a run
(:class:`SandboxResult`). Imports only the standard library and the sandbox's own helper modules,
so the environment config model can check a config with it before anything starts."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from nemo_like.environments.sandbox.memory import MIN_PROCESS_MEMORY_MB, check_memory_split, per_process_memory_mb
from nemo_like.environments.sandbox.mounts import check_extra_ro_binds

BWRAP_INSTALL_HINT = "install bubblewrap, e.g. `apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"

# Statuses of a run. Only "ok" means the prelude ran every test; everything else scores 0.
STATUSES = ("ok", "program_error", "crashed", "timeout", "output_limit", "sandbox_error")
MEMORY_MODES = ("cgroup", "rlimit", "none")

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailableError", "BWRAP_INSTALL_HINT", "STATUSES", "MEMORY_MODES",
           "MIN_PROCESS_MEMORY_MB"]


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or unusable here and the config does not allow the unsandboxed mode."""


# ------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and mode of a :class:`Sandbox`. All sizes are per run.

    timeout_s: wall-clock limit of one run (startup included). cpu_time_s: RLIMIT_CPU (None:
    ``ceil(timeout_s) + 1``). memory_limit_mb: memory of the whole run, all its processes together
    (0: none; see :mod:`~nemo_like.environments.sandbox.memory` for how, and why it must leave
    each of ``max_processes`` at least 24 MiB). max_processes: RLIMIT_NPROC (processes and threads
    of the run). max_file_size_mb: RLIMIT_FSIZE. max_open_files: RLIMIT_NOFILE.
    max_output_bytes: stdout+stderr cap (more kills the run). tmp_size_mb: size of each of the
    private ``/tmp`` and ``/dev/shm`` tmpfs. max_concurrency: runs at once in one Sandbox.
    bwrap_path: the bwrap binary (None: ``bwrap`` on PATH). python_executable: the interpreter (None:
    the real base interpreter behind ``sys.executable``; it runs with ``-I -S -B``, so the project's
    venv is not needed). hidden_paths: more host directories to hide where they fall inside
    something visible. extra_ro_binds: host paths shown to programs, read-only (nothing outside
    the system directories is, otherwise; Ray's temp dirs are refused). cgroup_parent: a delegated
    cgroup v2 directory (memory controller enabled for its children) to cap runs in (None: the
    trainer's own cgroup if it can, else the rlimit split). allow_unsandboxed: fall back to the
    rlimit-only mode (warned once) when bwrap is missing or unusable, instead of raising.
    """

    timeout_s: float = 5.0
    cpu_time_s: float | None = None
    memory_limit_mb: int = 512
    max_processes: int = 8  # 64 MiB each of the default 512 (see CodeEnvConfig)
    max_file_size_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    tmp_size_mb: int = 64
    max_concurrency: int = 2
    bwrap_path: str | None = None
    python_executable: str | None = None
    hidden_paths: tuple[str, ...] = ()
    extra_ro_binds: tuple[str, ...] = ()
    cgroup_parent: str | None = None
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
        check_memory_split(self.memory_limit_mb, self.max_processes, "SandboxConfig.")
        for name in ("bwrap_path", "python_executable", "cgroup_parent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SandboxConfig.{name} must be a non-empty string or None, got {value!r}")
        if isinstance(self.hidden_paths, str) or not all(
            isinstance(p, str) and os.path.isabs(p) for p in self.hidden_paths
        ):
            raise ValueError(f"SandboxConfig.hidden_paths must be absolute path strings, got {self.hidden_paths!r}")
        object.__setattr__(self, "hidden_paths", tuple(self.hidden_paths))
        object.__setattr__(self, "extra_ro_binds", check_extra_ro_binds(self.extra_ro_binds, "SandboxConfig.extra_ro_binds"))
        if not isinstance(self.allow_unsandboxed, bool):
            raise ValueError(f"SandboxConfig.allow_unsandboxed must be a bool, got {self.allow_unsandboxed!r}")

    def limits(self, timeout_s: float, memory_mode: str) -> list[tuple[str, int]]:
        """(rlimit name, value) pairs the prelude applies to the run's first process (and so to all)."""
        cpu = self.cpu_time_s if self.cpu_time_s is not None else math.ceil(timeout_s) + 1
        out = [
            ("RLIMIT_CPU", max(1, math.ceil(cpu))),
            ("RLIMIT_NPROC", self.max_processes),
            ("RLIMIT_FSIZE", self.max_file_size_mb << 20),
            ("RLIMIT_NOFILE", self.max_open_files),
            ("RLIMIT_CORE", 0),
        ]
        if memory_mode == "rlimit":
            out.append(("RLIMIT_AS", per_process_memory_mb(self.memory_limit_mb, self.max_processes) << 20))
        elif memory_mode == "cgroup":  # the cgroup caps the run; this turns one huge allocation into a MemoryError
            out.append(("RLIMIT_AS", self.memory_limit_mb << 20))
        return out

    def run_memory_bytes(self) -> int:
        """Most RAM a run can hold: its processes plus full /tmp and /dev/shm (the cgroup mode's memory.max)."""
        return (self.memory_limit_mb + 2 * self.tmp_size_mb) << 20


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


