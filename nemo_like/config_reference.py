"""The config reference page, generated from the pydantic schema: every key with its type, default and
help text (the comment above the field, or beside it, in the source), one table per section.

    uv run python -m nemo_like.config_reference > docs/reference/config.md

``tests/unit/test_config_reference.py`` fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import textwrap
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.dpo import DPOConfig
from nemo_like.algorithms.policy_losses import LOSSES, POLICY_LOSSES
from nemo_like.algorithms.rm import RMConfig
from nemo_like.algorithms.sft import SFTConfig
from nemo_like.config import MasterConfig, inheritance_rules_markdown
from nemo_like.environments.registry import builtin_envs, env_config_model
from nemo_like.gym.config import GymMasterConfig
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
    if origin is typing.Annotated:  # a tagged union's branch, or a constrained type: the type itself
        return _type_name(typing.get_args(ann)[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if not isinstance(a, str) else f'"{a}"' for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(ann, "__name__", str(ann))


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, str):  # a default computed from the environment (the cache dir): the same on every machine
        cache = os.environ.get("NEMO_LIKE_CACHE")
        value = value.replace(cache, "$NEMO_LIKE_CACHE") if cache else value.replace(os.path.expanduser("~"), "~")
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text.replace("|", "\\|")


def _field_default(f: Any) -> Any:
    if f.default is PydanticUndefined and f.default_factory is None:
        return PydanticUndefined
    return f.default_factory() if f.default_factory is not None else f.default


def _nested(ann: Any) -> list[type[BaseModel]]:
    args = typing.get_args(ann) or (ann,)
    if typing.get_origin(ann) is typing.Annotated:
        args = (args[0],)
    found = []
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        elif typing.get_origin(a) in (list, typing.Annotated, typing.Union, types.UnionType):
            found += _nested(a)
    return list(dict.fromkeys(found))  # X | list[X]: one section


def _instance(model: type[BaseModel], default: Any) -> BaseModel | None:
    """The section's defaults as its parent sets them (``critic.optimizer`` has its own lr), else the
    model's own, else None (a section with required keys)."""
    if isinstance(default, model):
        return default
    try:
        return model()
    except Exception:  # required keys
        return None


class _Page:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.rendered: dict[tuple[type, str], str] = {}  # (model, its defaults) -> the first key shown

    def table(self, prefix: str, model: type[BaseModel], instance: BaseModel | None) -> list[tuple[str, Any, Any]]:
        helps = field_help(model)
        self.out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        children = []
        for name, f in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            default = getattr(instance, name) if instance is not None else _field_default(f)
            nested = _nested(f.annotation)
            shown = "required" if default is PydanticUndefined else _show(default)
            help_text = re.sub(r"\s+", " ", helps.get(name, "")).replace("|", "\\|")
            self.out.append(f"| `{key}` | {_type_name(f.annotation)} | {shown} | {help_text} |")
            # A dict of sections ({name: section}) documents one entry, under <name>.
            entry = f"{key}.<name>" if typing.get_origin(f.annotation) is dict else key
            children += [(entry, m, default) for m in nested]
        self.out.append("")
        return children

    def section(self, prefix: str, model: type[BaseModel], default: Any, label: str = "") -> None:
        instance = _instance(model, default)
        fingerprint = (model, repr(instance.model_dump()) if instance is not None else "")
        heading = f"### `{prefix}`" + (f" ({label})" if label else "")
        if fingerprint in self.rendered:
            self.out += [heading, "", f"The same keys and defaults as `{self.rendered[fingerprint]}`.", ""]
            return
        self.rendered[fingerprint] = prefix
        doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ != BaseModel.__doc__ else ""
        self.out += [heading, ""]
        if doc:
            self.out += [" ".join(doc.split("\n\n")[0].split()), ""]
        if model.model_config.get("extra") == "allow":
            self.out += ["Also takes the options of what this section selects (see *Options of registered "
                         "components*).", ""]
        self.children(self.table(prefix, model, instance))

    def children(self, children: list[tuple[str, Any, Any]]) -> None:
        kinds: dict[str, int] = {}
        for key, _, _ in children:
            kinds[key] = kinds.get(key, 0) + 1
        for key, m, default in children:
            self.section(key, m, default, label=m.__name__ if kinds[key] > 1 else "")


def _top(title: str, model: type[BaseModel], page: _Page) -> None:
    page.out += [f"## {title}", ""]
    page.children(page.table("", model, None))


def _options(page: _Page) -> None:
    out = page.out
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
    for name in builtin_envs():  # what else is installed differs from one machine to the next
        model = env_config_model(name)
        if model is not None:
            page.section(f"env.{name}", model, None)


def render_config_reference() -> str:
    page = _Page()
    page.out += ["# Config reference", "",
                 "Generated from the schema by `uv run python -m nemo_like.config_reference > "
                 "docs/reference/config.md`; a test fails when this page is stale. How configs are written, "
                 "inherited and overridden: [getting started](../getting_started.md).", ""]
    page.out += [inheritance_rules_markdown(), ""]
    _top("Language-model runs (`examples/run_grpo_math.py`)", MasterConfig, page)
    _options(page)
    page.out.append("")
    page.rendered.clear()
    _top("Gym agents (`examples/run_grpo_gym.py`)", GymMasterConfig, page)
    # The offline trainers: a section another run already showed with the same defaults is referred to.
    for title, model in (("Reward-model training (`examples/run_rm.py`)", RMConfig),
                         ("DPO (`examples/run_dpo.py`)", DPOConfig), ("SFT (`examples/run_sft.py`)", SFTConfig)):
        page.out.append("")
        _top(title, model, page)
    return "\n".join(line.rstrip() for line in page.out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_config_reference())
