"""What environments a config can name here, where each comes from, and its ``env.<name>`` keys.

``uv run python -m nemo_like.environments [--import MODULE ...] [--json] [NAME ...]`` lists the
built-ins, those of installed packages (entry-point group ``nemo_like.environments``) and those the
``--import`` modules register (imported as a config's ``imports:`` is), each with its config keys,
their types, defaults and help text (the comment above the field in its ``config_model``). An
environment that cannot be loaded is listed with the error instead of its keys: one broken package,
or a library that is not installed, must not hide the rest.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from nemo_like.environments.env_config import EnvConfig
from nemo_like.environments.registry import ENV_REGISTRY, entry_point_package

__all__ = ["EnvInfo", "KeyInfo", "describe_env", "catalog", "format_catalog", "main"]


@dataclass
class KeyInfo:
    name: str
    type: str
    default: Any  # JSON-ready; None with ``required``
    required: bool
    help: str


@dataclass
class EnvInfo:
    name: str
    source: str  # "built-in", "package <name> <version>" or "registered in code" (register_env, imports:)
    target: str  # the class's import path
    summary: str = ""  # the first line of the class's docstring
    checked: bool = False  # whether it declares a config_model (env.<name> is validated)
    keys: list[KeyInfo] = field(default_factory=list)
    error: str | None = None


def _type_name(ann: Any) -> str:
    if ann is type(None):
        return "null"
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, (str, bool, int, float)) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", str(origin))
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _keys(model: type) -> list[KeyInfo]:
    from nemo_like.config_reference import field_help  # lazily: it imports every config schema

    help_of = field_help(model)
    out = []
    for name, f in model.model_fields.items():
        if name in EnvConfig.model_fields:
            continue  # the keys every environment takes are listed once, under the table
        required = f.is_required()
        default = None if required else _jsonable(f.get_default(call_default_factory=True))
        out.append(KeyInfo(name, _type_name(f.annotation), default, required, help_of.get(name, "")))
    return out


def _source(name: str) -> str:
    package = entry_point_package(name)
    if package is not None:
        return f"package {package}"
    # A built-in's name registered again with another class (overwrite=True) is the code's now.
    return "built-in" if ENV_REGISTRY.is_builtin(name) else "registered in code"


def describe_env(name: str) -> EnvInfo:
    """``name``'s entry; ``KeyError`` (with a did-you-mean) when nothing is registered under it."""
    if name not in ENV_REGISTRY:
        ENV_REGISTRY.get(name)  # the registry's KeyError: what is registered, and the closest name
    target = dict(ENV_REGISTRY.items())[name]
    path = target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"
    info = EnvInfo(name, _source(name), path)
    try:
        cls = ENV_REGISTRY.get(name)
        info.target = f"{cls.__module__}.{cls.__qualname__}"
        # Its own docstring only: an inherited one describes the base class, not this environment.
        info.summary = inspect.cleandoc(cls.__dict__.get("__doc__") or "").split("\n\n")[0].replace("\n", " ")
        model = getattr(cls, "config_model", None)
        if model is not None:
            if not (isinstance(model, type) and hasattr(model, "model_fields")):
                raise TypeError(f"config_model of {info.target} is {model!r}, not a pydantic model class")
            info.checked, info.keys = True, _keys(model)
    except Exception as e:  # a missing library, a broken package: shown in its row, the others still listed
        info.error = str(e) if name in str(e) else f"environment {name!r}: {type(e).__name__}: {e}"
    return info


def catalog(names: list[str] | None = None) -> list[EnvInfo]:
    """Every registered environment (or ``names``), sorted as given."""
    return [describe_env(n) for n in (names if names else ENV_REGISTRY.names())]


def format_catalog(infos: list[EnvInfo]) -> str:
    lines: list[str] = []
    for info in infos:
        lines.append(f"{info.name}  ({info.source}; {info.target})")
        if info.summary:
            lines.append(f"    {info.summary}")
        if info.error:
            lines.append(f"    error: {info.error}")
        elif not info.checked:
            lines.append(f"    env.{info.name}: not checked (the class declares no config_model; any mapping is passed on)")
        elif not info.keys:
            lines.append(f"    env.{info.name}: no keys of its own")
        for k in info.keys:
            default = "required" if k.required else f"default {json.dumps(k.default)}"
            lines.append(f"    env.{info.name}.{k.name}: {k.type}, {default}")
            if k.help:
                lines.append(f"        {k.help}")
        lines.append("")
    from nemo_like.config_reference import field_help

    common = ", ".join(f"{name} ({text})" for name, text in field_help(EnvConfig).items())
    lines.append(f"Every env.<name> also takes: {common}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_like.environments",
        description="List the environments a config can name (env_name), where each comes from, and its "
                    "env.<name> keys with their defaults.")
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these environments")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (comma-separated or repeated), as a config's imports: does")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of text")
    args = parser.parse_args(argv)
    modules = [m.strip() for arg in args.imports for m in arg.split(",") if m.strip()]
    if modules:
        from nemo_like.config import import_user_modules  # the loader of a config's imports:, not a second one

        try:
            import_user_modules(modules, where="--import")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        infos = catalog(args.names)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    for info in infos:
        if info.error:  # also on stderr: a script that reads the listing sees it without parsing rows
            print(f"warning: {info.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=1))
    else:
        sys.stdout.write(format_catalog(infos))
    return 0
