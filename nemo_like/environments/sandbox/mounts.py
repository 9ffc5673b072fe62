"""What of the host's file system a sandboxed program sees: an allowlist, not a denylist.

The sandbox root is bwrap's own empty tmpfs. Onto it go, read-only:

* the system directories (:data:`SYSTEM_DIRS`: ``/usr``, ``/etc`` and the ``/bin``/``/lib*`` dirs or
  their merged-usr symlinks): what any program needs to run, and nothing of the machine's data;
* of the sandbox interpreter's own install, only what it needs: the binary, its shared libraries
  (the non-system ones it maps at start, and the ``.so`` files next to them) and its ``sys.path``
  dirs (stdlib, ``lib-dynload``); the install's ``site-packages`` is hidden under an empty
  tmpfs (it runs with ``-I -S``: no site packages) and so is the rest of the tree (its ``bin``
  with other tools, a home directory around it);
* the directories listed in ``extra_ro_binds``.

So ``/opt``, ``/srv``, ``/data``, ``/mnt``, ``/var``, ``/run``, ``/root``, ``/home``, ``/work``, the host
``/tmp`` and everything else are simply absent. Sensitive dirs that lie *inside* something visible
(the project, the trainer's cwd and home, ``$NEMO_LIKE_CACHE``, ``$HF_HOME``, Ray's temp dirs,
``hidden_paths``) get an empty read-only tmpfs over them, unless they are themselves listed.
Ray's temp dirs (its sockets: anyone who can reach them can run code in the cluster) can never be
listed: :func:`ray_dir_conflict` refuses them, anything inside them and anything containing them.

Imports nothing of the project: the config model checks ``extra_ro_binds`` with this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence

__all__ = [
    "SYSTEM_DIRS",
    "SAFE_ENV",
    "InterpreterView",
    "probe_interpreter",
    "sensitive_dirs",
    "ray_temp_dirs",
    "ray_dir_conflict",
    "check_extra_ro_binds",
    "filesystem_args",
    "is_within",
]

SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# A Ray temp dir holds this symlink to the newest session (whose sockets/ dir is what matters).
_RAY_MARKER = "session_latest"
_SCAN_LIMIT = 4096  # entries of a listed dir checked for a Ray temp dir inside it


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def dedupe_nested(paths: Iterable[str]) -> list[str]:
    """Drop duplicates and paths inside another path of the list (shortest first)."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths}, key=len):
        if not any(is_within(p, q) for q in out):
            out.append(p)
    return out


# ------------------------------------------------------------------------------ the interpreter
class InterpreterView:
    """The paths of the interpreter's install a run needs (``binds``) and must not see (``masks``)."""

    def __init__(self, binds: list[str], masks: list[str]) -> None:
        self.binds, self.masks = binds, masks


_PROBE = r"""
import json, os, resource, sys, sysconfig
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            maps.add(parts[5].rstrip("\n"))
print(json.dumps({
    "executable": os.path.realpath(sys.executable),
    "path": [os.path.realpath(p) for p in sys.path if p and os.path.exists(p)],
    "maps": sorted(maps),
    "site": [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")],
}))
"""


def _system_path(p: str) -> bool:
    return any(is_within(p, os.path.realpath(d)) for d in SYSTEM_DIRS if os.path.isdir(d))


def probe_interpreter(python: str) -> InterpreterView:
    """Ask ``python`` (run as the sandbox runs it) what it loads; raises RuntimeError if it cannot run."""
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-B", "-c", _PROBE], capture_output=True, text=True, timeout=30, env=SAFE_ENV, cwd="/"
        )
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise RuntimeError(f"cannot run the sandbox interpreter {python!r}: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"the sandbox interpreter {python!r} does not work (exit {out.returncode}): {out.stderr[-500:]}")
    dirs = [p for p in info["path"] if os.path.isdir(p)]
    files = [info["executable"]] + [p for p in info["path"] if os.path.isfile(p)]
    for lib in info["maps"]:
        if ".so" not in os.path.basename(lib) or _system_path(lib) or not os.path.isfile(lib):
            continue
        # its neighbours too: libraries an extension module loads later usually sit next to it
        # (e.g. a standalone build's lib/); a symlinked name (libpython3.x.so.1.0) is bound as a file
        folder = os.path.dirname(lib)
        for entry in sorted(os.listdir(folder)):
            full = os.path.join(folder, entry)
            if ".so" in entry and os.path.isfile(full):
                files.append(full)
    binds = dedupe_nested(dirs + [f for f in files if not any(is_within(f, d) for d in dirs)])
    binds = [b for b in binds if not _system_path(b)]
    masks = [os.path.realpath(s) for s in info["site"] if s]
    masks = [m for m in dict.fromkeys(masks) if os.path.isdir(m) and any(is_within(m, b) and m != b for b in binds)]
    return InterpreterView(binds, masks)


# ------------------------------------------------------------------------------ sensitive dirs
def _project_root() -> str:
    # nemo_like/environments/sandbox/mounts.py -> the directory holding the nemo_like package
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))


def ray_temp_dirs() -> list[str]:
    """Where Ray keeps its sessions and sockets: its defaults, the env's choices and the live node's."""
    dirs = ["/tmp/ray", os.path.join(tempfile.gettempdir(), "ray")]
    for var in ("RAY_TMPDIR", "TMPDIR"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "ray"))
    if os.environ.get("NEMO_LIKE_RAY_TMPDIR"):  # nemo_like.distributed.init_ray's own temp dir
        dirs.append(os.environ["NEMO_LIKE_RAY_TMPDIR"])
    ray = sys.modules.get("ray")  # never imported here: only a process already in Ray has a live node
    if ray is not None:
        worker_mod = getattr(getattr(ray, "_private", None), "worker", None)
        for node in (getattr(getattr(worker_mod, "global_worker", None), "node", None), getattr(worker_mod, "_global_node", None)):
            try:
                dirs.append(node.get_temp_dir_path())
            except Exception:  # not connected, or Ray's internals moved
                pass
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs if d))


def ray_dir_conflict(path: str, known: Sequence[str] | None = None) -> str | None:
    """Why ``path`` must not be visible to programs (it is, holds or lies in a Ray temp dir), or None."""
    real = os.path.realpath(path)
    for ray_dir in ray_temp_dirs() if known is None else known:
        if is_within(real, ray_dir) or is_within(ray_dir, real):
            return f"{path} overlaps Ray's temp dir {ray_dir}"
    cur = real
    while True:  # the dir itself or a parent is a Ray temp dir (a custom one nobody told us about)
        if os.path.lexists(os.path.join(cur, _RAY_MARKER)):
            return f"{path} is inside a Ray temp dir ({cur} holds {_RAY_MARKER})"
        if cur == "/":
            break
        cur = os.path.dirname(cur)
    try:  # a Ray temp dir directly inside it (e.g. /tmp/<name>)
        with os.scandir(real) as it:
            for i, entry in enumerate(it):
                if i >= _SCAN_LIMIT:
                    break
                if entry.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(entry.path, _RAY_MARKER)):
                    return f"{path} contains a Ray temp dir ({entry.path})"
    except OSError:
        pass
    return None


def check_extra_ro_binds(paths: Sequence[str], key: str = "extra_ro_binds") -> tuple[str, ...]:
    """Validate ``extra_ro_binds``: absolute existing dirs or files, none of them Ray's (ValueError)."""
    if isinstance(paths, (str, bytes)) or not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
        raise ValueError(f"{key} must be a list of absolute paths, got {paths!r}")
    for p in paths:
        if os.path.realpath(p) == "/":
            raise ValueError(f"{key}: / would make the whole host visible; list the directories programs need")
        # Ray's dirs first: one that does not exist yet (Ray not started) is still never to be shown.
        conflict = ray_dir_conflict(p)
        if conflict is not None:
            raise ValueError(f"{key}: {conflict}; Ray's sockets are never shown to sandboxed programs")
        if not os.path.exists(p):
            raise ValueError(f"{key}: {p} does not exist")
    return tuple(paths)


def sensitive_dirs(hidden_paths: Sequence[str] = ()) -> list[str]:
    """Host dirs to mask wherever they fall inside something visible (existing dirs, real paths)."""
    home = os.path.expanduser("~")
    candidates = [
        *hidden_paths,
        _project_root(),
        home,
        os.environ.get("NEMO_LIKE_CACHE") or os.path.join(home, ".cache", "nemo_like"),
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "huggingface"),
        *(os.environ.get(v, "") for v in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME")),
        tempfile.gettempdir(),
        *ray_temp_dirs(),
    ]
    try:
        candidates.append(os.getcwd())
    except OSError:
        pass
    out = []
    for p in candidates:
        if p and os.path.isabs(p) and os.path.isdir(p):
            out.append(os.path.realpath(p))
    return [p for p in dict.fromkeys(out) if p != "/"]


# ------------------------------------------------------------------------------ bwrap arguments
def filesystem_args(
    interpreter: InterpreterView, extra_ro_binds: Sequence[str], hidden: Sequence[str], tmp_size_bytes: int
) -> list[str]:
    """bwrap arguments building the sandbox's file system (see the module docstring)."""
    args: list[str] = []
    visible: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            visible.append(d)
    args += ["--dev", "/dev", "--proc", "/proc"]
    # private, size-capped and world-writable (sticky) scratch space; gone with the run
    for d in ("/tmp", "/dev/shm"):
        args += ["--perms", "1777", "--size", str(tmp_size_bytes), "--tmpfs", d]
    extra = [os.path.realpath(p) for p in extra_ro_binds]
    outer = dedupe_nested(interpreter.binds + extra)
    # a mask applies inside something visible (a listed path is shown as listed, though)
    listed = set(interpreter.binds) | set(extra)
    masks = [
        m for m in dict.fromkeys([*interpreter.masks, *hidden])
        if m not in listed and any(is_within(m, r) for r in visible + outer)
    ]
    # a bind inside something visible is needed only where a mask in between hides it
    binds = []
    for b in dict.fromkeys(interpreter.binds + extra):
        covering = [r for r in visible + outer if is_within(b, r) and r != b]
        if not covering or any(is_within(b, m) and any(is_within(m, r) for r in covering) for m in masks):
            binds.append(b)
    tmpfs_roots = set(masks) | {"/tmp", "/dev/shm"}
    roots = visible + binds + sorted(tmpfs_roots)

    def exists_inside(path: str) -> bool:
        """Whether ``path`` is already a directory in the sandbox at this point of the setup."""
        enclosing = [r for r in roots if is_within(path, r)]
        if not enclosing:
            return False  # on bwrap's empty root tmpfs
        deepest = max(enclosing, key=len)
        return path == deepest or deepest not in tmpfs_roots

    # mount parents before children (bwrap applies its operations in order), masks first
    ops = sorted([(b.count("/"), 1, b) for b in binds] + [(m.count("/"), 0, m) for m in masks])
    made: set[str] = set()
    for _, kind, path in ops:
        if kind == 0:
            args += ["--tmpfs", path]
            continue
        # recreate missing parents world-traversable (bwrap would make them 0700, which the run's
        # unprivileged uid could not enter)
        cur = ""
        for part in path.split("/")[1:-1]:
            cur += "/" + part
            if cur not in made and not exists_inside(cur):
                made.add(cur)
                args += ["--perms", "0755", "--dir", cur]
        args += ["--ro-bind", path, path]
    for m in masks:  # empty and read-only: no writing to (RAM-backed) hidden dirs either
        args += ["--remount-ro", m]
    # nor to bwrap's root tmpfs (not size-capped), which a user-namespace run would own
    return args + ["--remount-ro", "/"]
