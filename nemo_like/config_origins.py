"""Where each key of a loaded config came from (a file and line, a file it inherits, the command
line), and pydantic's errors as one line that names each bad key and its origin."""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from nemo_like.data.datasets import GENERATOR_KINDS

__all__ = ["Origin", "Path_", "Provenance", "format_validation_error", "origin_note", "walk_keys"]

Path_ = tuple[str | int, ...]  # a key's place in the config: ("data", "train", "generator", "kind")


# ---------------------------------------------------------------------------------------------
# Where each key came from
# ---------------------------------------------------------------------------------------------
class Origin(NamedTuple):
    file: str | None  # None: the command line
    line: int | None = None


def _shown(path: str) -> str:
    """A file as the user would type it: relative to the current directory when it lies under it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except (OSError, ValueError):
        return path


@dataclass
class Provenance:
    """The origin of every key of a loaded config (mappings too), through ``defaults:`` and overrides."""

    top: str | None = None  # the file that was loaded; keys from others are inherited
    origins: dict[Path_, Origin] = field(default_factory=dict)

    def describe(self, key: str) -> str | None:
        """``set in a.yaml:3``, ``inherited from base.yaml:12`` or ``command line`` for a dotted key."""
        origin = self.origins.get(tuple(int(p) if p.isdigit() else p for p in key.split(".")))
        if origin is None:
            return None
        if origin.file is None:
            return "command line"
        where = _shown(origin.file) + (f":{origin.line}" if origin.line else "")
        return f"set in {where}" if origin.file == self.top else f"inherited from {where}"

    def mark(self, path: Path_, value: Any, origin: Origin) -> None:
        """``path`` (and everything under it) now holds ``value``, written at ``origin``."""
        self.drop(path)
        for p, _ in walk_keys(value, path):
            self.origins[p] = origin

    def drop(self, path: Path_) -> None:
        for p in [p for p in self.origins if p[:len(path)] == path]:
            del self.origins[p]

    def keep_only(self, tree: dict) -> None:
        """Forget the keys ``tree`` no longer has (a replaced section's, a dropped option's)."""
        present = {p for p, _ in walk_keys(tree, ())}
        self.origins = {p: o for p, o in self.origins.items() if p in present}


def walk_keys(value: Any, path: Path_) -> typing.Iterator[tuple[Path_, Any]]:
    if path:
        yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from walk_keys(v, path + (k,))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def _readable_loc(loc: tuple) -> str:
    """``data.train.list[...].0.generator.reasoning_gym.dataset`` -> ``data.train.0.generator.dataset``:
    pydantic puts a union's tag or branch type in the location; the user wrote neither."""
    out: list[str] = []
    for x in map(str, loc):
        if x.startswith(("function-", "list[")) or (out and out[-1] == "generator" and x in GENERATOR_KINDS):
            continue
        out.append(x)
    return ".".join(out)


_DOTTED_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+")


def origin_note(text: str, provenance: Provenance | None, first: str = "") -> str:
    """`` (set in a.yaml:3)`` for the config key ``text`` is about (``first``, else the keys it names
    that a file or an override wrote); several keys are each named. Empty when none is known."""
    if provenance is None:
        return ""
    keys = list(dict.fromkeys(k for k in ([first] if first else []) + _DOTTED_KEY.findall(text)))
    found = [(k, d) for k in keys if (d := provenance.describe(k)) is not None]
    # A key and the section above it: the key says more.
    found = [(k, d) for k, d in found if not any(o != k and o.startswith(k + ".") for o, _ in found)]
    if not found:
        return ""
    if len(found) == 1:
        return f" ({found[0][1]})"
    return " (" + "; ".join(f"{k}: {d}" for k, d in found) + ")"


def _wrong_branch(err: dict) -> bool:
    """An error of the ``A | list[A]`` branch the value did not take: ``list[A]`` refusing a mapping,
    or ``A`` refusing a list."""
    if err["type"] == "list_type":
        return str(err["loc"][-1]).startswith("list[") if err["loc"] else False
    return err["type"] in ("model_type", "dict_type") and isinstance(err.get("input"), list)


def _taken_branches(errors: list) -> list:
    """pydantic reports a bad value of ``x: A | list[A]`` under both branches: keep the errors of the
    one the value took (a bad key of a list's item, not "should be a dictionary")."""
    def has_sibling(err: dict) -> bool:
        prefix = tuple(err["loc"][:-1])
        return any(o is not err and tuple(o["loc"][:len(prefix)]) == prefix and len(o["loc"]) > len(prefix)
                   and not _wrong_branch(o) for o in errors)

    return [err for err in errors if not (_wrong_branch(err) and has_sibling(err))]


def format_validation_error(e: ValidationError, provenance: Provenance | None = None) -> str:
    """pydantic's report on one line, each key named (``data.train.generator.min_value: unknown config
    key``) and, given ``provenance``, the file and line (or the command line) it came from."""
    errors = _taken_branches(e.errors())
    parts = []
    for err in errors:
        loc = _readable_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown config key"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
        # A section's own validator may already name the full key (loss_fn.tau: ...).
        text = f"{loc}: {msg}" if loc and not msg.startswith(loc + ".") else msg
        subject = loc if loc and not msg.startswith(loc + ".") else ""
        # A section's validator may name its own key first ("dataset: ..."): that key is the subject.
        if subject and (lead := re.match(r"([A-Za-z_]\w*): ", msg)) and provenance is not None \
                and provenance.describe(f"{subject}.{lead[1]}") is not None:
            subject = f"{subject}.{lead[1]}"
        parts.append(text + origin_note(msg, provenance, subject))
    return "; ".join(parts)
