"""The config reference page, generated from the pydantic schema: every key with its type, default and
help text (the comment above the field, or beside it, in the source), one table per section.

    uv run python -m nemo_like.config_reference > docs/reference/config.md

``tests/unit/test_config_reference.py`` fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.policy_losses import LOSSES, POLICY_LOSSES
from nemo_like.config import MasterConfig
from nemo_like.environments.registry import ENV_REGISTRY, env_config_model
from nemo_like.gym_config import GymMasterConfig
from nemo_like.models.generation.backends import GENERATION_BACKENDS
from nemo_like.models.policy.backends import POLICY_BACKENDS

__all__ = ["field_help", "render_config_reference"]


def field_help(model: type[BaseModel]) -> dict[str, str]:
    """``{field: help}`` from the source of ``model`` and its bases: the pydantic ``description`` if
    set, else the ``#`` comment lines just above the field's line, else the comment at its end."""
    out: dict[str, str] = {}
    for cls in reversed([c for c in model.__mro__ if isinstance(c, type) and issubclass(c, BaseModel)
                         and c is not BaseModel]):
        try:
            lines, _ = inspect.getsourcelines(cls)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent("".join(lines)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            i = node.lineno - 1  # in ``lines``
            above: list[str] = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                above.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            end = lines[node.end_lineno - 1]
            inline = end.split("  # ", 1)[1].strip() if "  # " in end else ""
            text = " ".join(above) or inline
            if text:
                out[node.target.id] = text
    for name, f in model.model_fields.items():
        if f.description:
            out[name] = f.description
    return out


def _type_name(ann: Any) -> str:
    if ann is type(None):
        return "null"
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if not isinstance(a, str) else f'"{a}"' for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(ann, "__name__", str(ann))


def _default(f: Any) -> str:
    if f.default is PydanticUndefined and f.default_factory is None:
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default
    if isinstance(value, BaseModel):
        return "(section)"
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text.replace("|", "\\|")


def _nested(ann: Any) -> list[type[BaseModel]]:
    args = typing.get_args(ann) or (ann,)
    found = []
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        elif typing.get_origin(a) is list:
            found += _nested(a)
    return found


def _section(prefix: str, model: type[BaseModel], out: list[str], seen: set[str]) -> None:
    helps = field_help(model)
    doc = inspect.cleandoc(model.__doc__ or "")
    if doc.startswith(("!!!", "Usage docs")) or model.__doc__ == BaseModel.__doc__:
        doc = ""
    out += [f"### `{prefix}`", ""]
    if doc:
        out += [" ".join(doc.split("\n\n")[0].split()), ""]
    if model.model_config.get("extra") == "allow":
        out += ["Also takes the options of what this section selects (see *Options of registered components*).", ""]
    out += ["| key | type | default | what it does |", "|---|---|---|---|"]
    children = []
    for name, f in model.model_fields.items():
        key = f"{prefix}.{name}"
        help_text = re.sub(r"\s+", " ", helps.get(name, "")).replace("|", "\\|")
        out.append(f"| `{key}` | {_type_name(f.annotation)} | {_default(f)} | {help_text} |")
        children += [(key, m) for m in _nested(f.annotation)]
    out.append("")
    for key, m in children:
        if key not in seen:
            seen.add(key)
            _section(key, m, out, seen)


def _top(title: str, model: type[BaseModel], out: list[str]) -> None:
    out += [f"## {title}", ""]
    seen: set[str] = set()
    helps = field_help(model)
    out += ["| key | type | default | what it does |", "|---|---|---|---|"]
    sections = []
    for name, f in model.model_fields.items():
        nested = _nested(f.annotation)
        help_text = re.sub(r"\s+", " ", helps.get(name, "")).replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(f.annotation)} | {_default(f) if not nested else '(section)'} | {help_text} |")
        sections += [(name, m) for m in nested]
    out.append("")
    for key, m in sections:
        seen.add(key)
        _section(key, m, out, seen)


def _options(out: list[str]) -> None:
    out += ["## Options of registered components", "",
            "A registered component may declare its own keys; they are written in the section that selects it "
            "and checked with the rest of the config. The built-in ones:", ""]
    for where, selector, registry in (("loss_fn", "loss_fn.name", LOSSES), ("loss_fn", "loss_fn.policy_loss", POLICY_LOSSES),
                                      ("grpo", "grpo.advantage_estimator", ADVANTAGE_ESTIMATORS),
                                      ("policy.generation", "policy.generation.backend", GENERATION_BACKENDS)):
        names = registry.names()
        out.append(f"- `{selector}`: {', '.join(f'`{n}`' for n in names)}"
                   + "".join(f"; `{n}` adds {', '.join(f'`{where}.{k}`' for k in registry.options(n).model_fields)}"
                             for n in names if registry.options(n) is not None))
    out.append(f"- `policy.backend`: {', '.join(f'`{n}`' for n in POLICY_BACKENDS.names())}")
    out += ["", "Each environment's typed config is `env.<name>`:", ""]
    for name in ENV_REGISTRY.names():
        model = env_config_model(name)
        if model is not None:
            _section(f"env.{name}", model, out, set())


def render_config_reference() -> str:
    out = ["# Config reference", "",
           "Generated from the schema by `uv run python -m nemo_like.config_reference > docs/reference/config.md`; "
           "a test fails when this page is stale. How configs are written, inherited and overridden: "
           "[getting started](../getting_started.md).", ""]
    _top("Language-model runs (`examples/run_grpo_math.py`)", MasterConfig, out)
    _options(out)
    out.append("")
    _top("Gym agents (`examples/run_grpo_gym.py`)", GymMasterConfig, out)
    return "\n".join(line.rstrip() for line in out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_config_reference())
