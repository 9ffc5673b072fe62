"""How the sandbox caps a run's memory across ALL its processes, and the per-run cgroup when it has one.

``memory_limit_mb`` is a cap per *run* (the program plus every process or thread it starts), never
per process, or a program could fork ``max_processes`` children that each fill the cap. Two modes,
decided once per :class:`~nemo_like.environments.sandbox.Sandbox` (its ``memory_mode``):

* ``"cgroup"``: the machine delegates a writable cgroup v2 subtree (the trainer's own cgroup, or
  ``cgroup_parent``, with the ``memory`` controller enabled for its children). Each run gets a child
  cgroup with ``memory.max`` = ``memory_limit_mb`` + the two tmpfs sizes (tmpfs pages the run
  writes are charged to it too), no swap, and ``memory.oom.group`` so an overrun kills the whole
  run. Each process also keeps RLIMIT_AS = ``memory_limit_mb``, so one huge allocation fails
  with a MemoryError instead of an OOM kill.
* ``"rlimit"`` (cgroup v1 machines, or no delegation, as in CI): each process gets RLIMIT_AS =
  ``memory_limit_mb / max_processes`` and RLIMIT_NPROC = ``max_processes`` counts the run's
  processes and threads (a fresh uid per run as root, a user namespace otherwise), so all of them
  together stay within ``memory_limit_mb``. The tmpfs sizes are capped on their own (bwrap
  ``--size``), so a run holds at most ``memory_limit_mb`` + 2 * ``tmp_size_mb`` in both modes.
  Python threads get 1 MiB stacks (glibc's default is RLIMIT_STACK, 8 MiB of the share each).
  Config checks refuse a share below :data:`MIN_PROCESS_MEMORY_MB`, what a Python process
  needs to start, import the harness and run a small thread pool.
* ``"none"``: ``memory_limit_mb`` is 0.

Moving a run into its cgroup: the launcher is ``sh -c 'echo 0 > <cgroup>/cgroup.procs && exec
"$@"'`` (writing 0 moves the writer), so bwrap and everything it starts are born inside the cgroup;
Python's ``preexec_fn`` would do the same but is unsafe in a threaded process.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time

__all__ = [
    "MIN_PROCESS_MEMORY_MB",
    "THREAD_STACK_BYTES",
    "per_process_memory_mb",
    "check_memory_split",
    "find_cgroup_parent",
    "RunCgroup",
]

# Measured with CPython 3.11 (-I -S): it starts at ~12 MiB of address space, ~16 MiB with the
# harness's imports; a 4-thread pool or a 2-process multiprocessing.Pool fits in 24 MiB with
# 1 MiB thread stacks.
MIN_PROCESS_MEMORY_MB = 24
THREAD_STACK_BYTES = 1 << 20

_CGROUP_MOUNT = "/sys/fs/cgroup"
_counter = itertools.count()


def per_process_memory_mb(memory_limit_mb: int, max_processes: int) -> int:
    """RLIMIT_AS share of each process in "rlimit" mode."""
    return memory_limit_mb // max_processes


def check_memory_split(memory_limit_mb: int, max_processes: int, prefix: str = "") -> None:
    """Refuse a per-run cap that leaves each of ``max_processes`` processes too little to start Python.

    Checked whatever mode the machine ends up in, so a config valid on one machine is valid on all.
    """
    if memory_limit_mb == 0:
        return
    share = per_process_memory_mb(memory_limit_mb, max_processes)
    if share < MIN_PROCESS_MEMORY_MB:
        raise ValueError(
            f"{prefix}memory_limit_mb / {prefix}max_processes = {memory_limit_mb} / {max_processes} = {share} MiB "
            f"per process, below the {MIN_PROCESS_MEMORY_MB} MiB a sandboxed Python process needs (the cap is per "
            f"run, shared by up to max_processes processes and threads): raise {prefix}memory_limit_mb to at "
            f"least {MIN_PROCESS_MEMORY_MB * max_processes} or lower {prefix}max_processes to at most "
            f"{max(1, memory_limit_mb // MIN_PROCESS_MEMORY_MB)}"
        )


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _own_cgroup(mount: str, proc_self_cgroup: str) -> str | None:
    """Directory of this process's cgroup in the unified (v2) hierarchy, or None (v1, or none)."""
    if not os.path.isfile(os.path.join(mount, "cgroup.controllers")):
        return None  # cgroup v1 or hybrid: no memory controller in a v2 tree we can use
    try:
        lines = _read(proc_self_cgroup).splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return os.path.join(mount, line[3:].lstrip("/"))
    return None


def usable_cgroup_parent(path: str) -> str | None:
    """Why ``path`` cannot hold per-run memory cgroups, or None if it can (probed with a real child)."""
    try:
        controls = _read(os.path.join(path, "cgroup.subtree_control")).split()
    except OSError as e:
        return f"{path} is not a cgroup v2 directory ({e.strerror})"
    if "memory" not in controls:
        return f"the memory controller is not enabled for the children of {path} (cgroup.subtree_control: {' '.join(controls) or 'empty'})"
    probe = os.path.join(path, f"nemo_like_probe_{os.getpid()}_{secrets.token_hex(4)}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return f"cannot create a cgroup under {path} ({e.strerror})"
    try:
        with open(os.path.join(probe, "memory.max"), "w") as f:
            f.write("max")
    except OSError as e:
        return f"cannot set memory.max under {path} ({e.strerror})"
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass
    return None


def find_cgroup_parent(
    configured: str | None = None, *, mount: str = _CGROUP_MOUNT, proc_self_cgroup: str = "/proc/self/cgroup"
) -> tuple[str | None, str]:
    """(the cgroup v2 directory per-run cgroups go under, or None; why, in words).

    ``configured`` (``cgroup_parent``) must work, else ValueError. Otherwise the trainer's own cgroup
    is used when it already delegates the memory controller to its children; nothing in the
    hierarchy is changed to get there (enabling a controller or moving the trainer would affect
    processes that are not ours).
    """
    if configured is not None:
        why = usable_cgroup_parent(configured)
        if why is not None:
            raise ValueError(f"cgroup_parent: {why}")
        return configured, f"cgroup v2 under {configured} (configured)"
    own = _own_cgroup(mount, proc_self_cgroup)
    if own is None:
        return None, "no cgroup v2 hierarchy at " + mount
    why = usable_cgroup_parent(own)
    if why is not None:
        return None, why
    return own, f"cgroup v2 under {own} (the trainer's own cgroup)"


class RunCgroup:
    """One run's cgroup: created with its limits before the run, removed after its processes are gone."""

    def __init__(self, parent: str, max_bytes: int) -> None:
        self.path = os.path.join(parent, f"nemo_like_sbx_{os.getpid()}_{next(_counter)}")
        os.mkdir(self.path)
        try:
            self._write("memory.max", str(max_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if os.path.exists(os.path.join(self.path, name)):  # absent without swap accounting
                    self._write(name, value)
        except OSError:
            self.remove()
            raise

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def launcher(self) -> list[str]:
        """argv prefix that moves itself into this cgroup, then execs the rest of the argv."""
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs")]

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup (cgroup.kill, Linux >= 5.14), wherever it went:
        it also catches what left the process group in the unsandboxed mode."""
        try:
            self._write("cgroup.kill", "1")
        except OSError:
            pass

    def oom_killed(self) -> bool:
        try:
            for line in _read(os.path.join(self.path, "memory.events")).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def remove(self) -> None:
        # rmdir fails with EBUSY until the kernel has released the last exited task; the run's
        # processes are already dead when this is called, so that takes milliseconds
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
