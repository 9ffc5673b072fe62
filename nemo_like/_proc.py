"""Process identity for the stack dumps (stdlib only: the package's ``__init__`` imports it)."""

from __future__ import annotations

from pathlib import Path


def process_start_time(pid: int | str = "self") -> str | None:
    """The kernel's start time of a process (field 22 of /proc/<pid>/stat): with the pid, it names one
    process even after the pid is reused. None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]
