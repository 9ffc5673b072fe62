"""Where each extension says it ran (the tests read it): a line appended to $MY_EXTENSIONS_TRACE when set.
Ray workers and environment actors inherit the variable from the driver."""

from __future__ import annotations

import os


def trace(kind: str, detail: str) -> None:
    if path := os.environ.get("MY_EXTENSIONS_TRACE"):
        with open(path, "a") as f:
            f.write(f"{kind} {os.getpid()} {detail}\n")
