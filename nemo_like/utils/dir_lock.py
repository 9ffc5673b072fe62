"""A directory that one live process at a time may write: ``<dir>/.lock``.

flock(2) on the file is the lock itself. The kernel drops it when its holder exits, however it exits
(kill -9 included), so a lock is never held by a dead process. The file's content names the holder
(pid, host, start time, command) for the error a second process gets; a new holder that finds a
name in a lock nobody holds knows the previous run died without releasing it, and says so.

Without flock (no fcntl, or a filesystem that refuses it) the named pid is checked instead. A lock
named by another host is never taken over: from here nobody can tell whether that process still
runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

from nemo_like.utils.checkpoint_io import CheckpointError

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
_HOST = socket.gethostname()


class DirLockedError(CheckpointError):
    """The directory is in use by another live process (named in the message)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _read(fd: int) -> dict[str, Any] | None:
    raw = os.pread(fd, 65536, 0)
    try:
        data = json.loads(raw) if raw.strip() else None
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _try_flock(fd: int, mode: int) -> bool | None:
    """True: taken; False: held by someone else; None: flock is not available here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # e.g. ENOLCK / EOPNOTSUPP on some network filesystems
        return None


class DirLock:
    """``acquire()`` / ``release()`` the lock of ``directory``; ``check_free()`` only looks."""

    _fd: int | None = None

    def __init__(self, directory: str | os.PathLike[str], label: str | None = None):
        self.path = Path(directory) / LOCK_FILE
        self.label = label or str(directory)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def describe(self, holder: dict[str, Any] | None) -> str:
        if holder is None:
            return "a process that has not written its name yet"
        who = f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
        if holder["pid"] == os.getpid() and holder.get("host") == _HOST:
            return f"this process ({who}): close the other trainer or experiment first"
        command = holder.get("command")
        return who + (f": {command}" if command else "")

    def _refusal(self, holder: dict[str, Any] | None) -> DirLockedError:
        return DirLockedError(f"{self.label} is in use by another run ({self.describe(holder)}); stop that "
                              "run or use another directory")

    def _judge_unheld(self, holder: dict[str, Any] | None, flocked: bool) -> bool:
        """For a lock file we could lock (or could not check): True when a dead holder left its name."""
        if holder is None:
            return False
        if holder.get("host") != _HOST:
            raise DirLockedError(
                f"{self.label} was locked by pid {holder['pid']} on host {holder.get('host')} (started "
                f"{holder.get('started')}), which cannot be checked from {_HOST}; if that run has ended, "
                f"delete {self.path}")
        if not flocked and _pid_alive(holder["pid"]):
            raise self._refusal(holder)
        return True

    def check_free(self) -> None:
        """Raises DirLockedError when another live process holds the lock; takes nothing."""
        if self.held:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            flocked = _try_flock(fd, fcntl.LOCK_SH if fcntl else 0)
            if flocked is False:
                raise self._refusal(_read(fd))
            self._judge_unheld(_read(fd), bool(flocked))
        finally:
            os.close(fd)  # drops the shared flock of the look

    def acquire(self, wait_s: float = 2.0) -> None:
        """Takes the lock (a dead holder's with a warning); DirLockedError when a live process has it."""
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + wait_s
            while (flocked := _try_flock(fd, fcntl.LOCK_EX if fcntl else 0)) is False:
                holder = _read(fd)
                # Held, but by nobody named, or by a name that is dead here: a holder between taking
                # the lock and writing its name, one releasing it, or a check_free look; each lasts
                # moments.
                transient = holder is None or (holder.get("host") == _HOST and not _pid_alive(holder["pid"]))
                if not transient or time.monotonic() > deadline:
                    raise self._refusal(holder)
                time.sleep(0.05)
            previous = _read(fd)
            if self._judge_unheld(previous, bool(flocked)):
                warnings.warn(f"{self.label}: taking over the lock of pid {previous['pid']} (started "
                              f"{previous.get('started')}), which ended without releasing it; its unfinished "
                              "save, if any, is discarded", stacklevel=3)
            me = {"pid": os.getpid(), "host": _HOST,
                  "started": datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"}
            data = json.dumps(me).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Drops the lock (idempotent); an empty lock file stays behind, meaning "free"."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # while still holding it: nobody reads a name of a process that let go
        finally:
            os.close(fd)

    def __del__(self) -> None:
        # A lock object dropped without release() must not keep the directory locked until exit.
        try:
            self.release()
        except Exception:  # interpreter shutdown: the kernel drops the flock at exit anyway
            pass
