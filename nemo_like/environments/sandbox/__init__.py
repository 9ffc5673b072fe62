"""The code sandbox: model-written programs run under bubblewrap with an allowlisted filesystem, no
network, a seccomp filter, memory and process limits and a wall-clock timeout.

- ``core``: :class:`Sandbox` (one run, or many at once with :func:`run_many`) and what it refuses;
- ``config``: :class:`SandboxConfig` and :class:`SandboxResult`;
- ``mounts``: the filesystem view (the interpreter's files read-only, nothing of the trainer's);
- ``seccomp``: the syscall filter;
- ``memory``: how a run's memory is capped (a cgroup when one can be made, else rlimits);
- ``prelude``: the harness the sandboxed interpreter runs before the program;
- ``run``: reading a run's output and results back, and killing what it left.
"""

from nemo_like.environments.sandbox.core import (
    BWRAP_INSTALL_HINT,
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    run_many,
)

__all__ = ["BWRAP_INSTALL_HINT", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError", "run_many"]
