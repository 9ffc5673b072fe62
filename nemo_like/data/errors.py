"""The data error type, apart from the loaders: generators (code tasks, tool tasks) raise it and the
loaders import those generators, so it cannot live in either without an import cycle."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data file or dataset is missing or malformed; the message names the file (and line when known)."""
