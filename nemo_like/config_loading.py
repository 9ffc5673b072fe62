"""Reading configs: YAML files with ``defaults:`` inheritance, ``key=value`` overrides and the command
line, tracking where each key came from (``nemo_like.config_origins`` names it in errors).
Schema-agnostic: the schema (a pydantic model) is passed in, so the language-model, reward-model and
gym configs share these rules.

Inheritance merges mappings key by key, except where a section's *selecting key* changes (a
generator's ``kind``, ``grpo.advantage_estimator``, ``loss_fn.name``, ...): the parent's keys that
belong to its own selection are dropped, as they would not be keys of the child's. See ``Selector``.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from nemo_like.config_origins import Origin, Path_, Provenance, format_validation_error, walk_keys

__all__ = ["ConfigError", "IMPORT_PREFIX", "Origin", "Provenance", "Selector", "apply_overrides",
           "format_validation_error", "load_yaml_with_defaults", "load_yaml_with_provenance", "parse_cli",
           "schema_field", "schema_has", "selectors_of", "with_imports"]


class ConfigError(ValueError):
    """A bad config file, key or value. The CLI prints it on one line and exits with code 2."""


# ---------------------------------------------------------------------------------------------
# The schema's shape
# ---------------------------------------------------------------------------------------------
def _models(ann: Any, lists: bool = True) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``X | list[X]``, a tagged union)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _models(typing.get_args(ann)[0], lists)
    if origin is list and not lists:
        return []
    if origin in (typing.Union, types.UnionType, list):
        return list(dict.fromkeys(m for a in typing.get_args(ann) for m in _models(a, lists)))
    return []


def schema_field(keys: list[str], schema: type[BaseModel]) -> Any:
    """The field of ``schema`` at ``keys`` (``["grpo", "dynamic_sampling", "enabled"]``), or None where
    the schema has none (a missing key, or a key under a free-form mapping). Under a union of sections
    (a generator's kinds) a key of any of them counts."""
    models: list[type[BaseModel]] = [schema]
    found = None
    for k in keys:
        found = next((m.model_fields[k] for m in models if k in m.model_fields), None)
        if found is None:
            return None
        models = _models(found.annotation)
    return found


def schema_has(keys: list[str], schema: type[BaseModel]) -> bool:
    """``keys`` name a field of the schema, or lie under a free-form mapping (``env.<name>.<option>``),
    or name a key of a section that takes the options of what it selects (``loss_fn.<option>``, checked
    when the config is validated)."""
    for i in range(1, len(keys) + 1):
        f = schema_field(keys[:i], schema)
        if f is None:
            parents = _models(schema_field(keys[:i - 1], schema).annotation) if i > 1 else [schema]
            return i == len(keys) and any(m.model_config.get("extra") == "allow" for m in parents)
        if not _models(f.annotation) and typing.get_origin(f.annotation) is dict:
            return True
    return True


def _schema_fields(keys: list[str], schema: type[BaseModel]) -> list[str]:
    """Field names the schema has at ``keys`` (for a did-you-mean when the YAML has no such section)."""
    models = [schema] if not keys else _models(f.annotation) if (f := schema_field(keys, schema)) else []
    return list(dict.fromkeys(name for m in models for name in m.model_fields))


# ---------------------------------------------------------------------------------------------
# Selecting keys
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selector:
    """A section whose ``keys`` choose what the rest of it means. When a child (a file that inherits,
    or an override) gives one of them another value than the parent's, the parent's keys outside
    ``keep`` are dropped before the child's are merged in: ``keep`` None (a tagged union, a
    generator's ``kind``) replaces the section whole; else ``keep`` are the section's own fields and
    what is dropped is the options of the parent's selection (``grpo``'s estimator options)."""

    keys: tuple[str, ...]
    defaults: tuple[Any, ...]  # each key's value when the section leaves it out
    keep: frozenset[str] | None = None

    def changed(self, base: dict, top: dict) -> bool:
        return any(k in top and top[k] != base.get(k, d) for k, d in zip(self.keys, self.defaults))

    def rebase(self, base: dict, top: dict) -> dict:
        """What of ``base`` (the parent's section) ``top`` (the child's) is merged into."""
        if not self.changed(base, top):
            return base
        return {} if self.keep is None else {k: v for k, v in base.items() if k in self.keep}


def _tag(members: list[type[BaseModel]]) -> tuple[str, Any] | None:
    """The Literal field every member of a union of sections has (its tag), and the tag of the member
    that is taken when the key is left out (a default on its field)."""
    if len(members) < 2:
        return None
    for name in members[0].model_fields:
        fields = [m.model_fields.get(name) for m in members]
        if all(x is not None and typing.get_origin(x.annotation) is typing.Literal for x in fields):
            default = next((x.default for x in fields if x.default is not None and not x.is_required()), None)
            return name, default
    return None


def selectors_of(schema: type[BaseModel], selecting: dict[str, tuple[str, ...]] | None = None,
                 ) -> dict[Path_, Selector]:
    """The schema's selectors by section path: every union of sections with a tag (found in the
    schema), and the sections named in ``selecting`` (``{"grpo": ("advantage_estimator",)}``: a section
    that takes the options of what those keys select)."""
    out: dict[Path_, Selector] = {}

    def visit(model: type[BaseModel], path: Path_, depth: int) -> None:
        if depth > 8:
            return
        for name, f in model.model_fields.items():
            here = path + (name,)
            members = _models(f.annotation, lists=False)
            if (tag := _tag(members)) is not None:
                out[here] = Selector((tag[0],), (tag[1],))
            for m in _models(f.annotation):
                visit(m, here, depth + 1)

    visit(schema, (), 0)
    for dotted, keys in (selecting or {}).items():
        path = tuple(dotted.split("."))
        f = schema_field(list(path), schema)
        model = (_models(f.annotation) or [None])[0] if f is not None else None
        if model is None:
            out[path] = Selector(tuple(keys), tuple(None for _ in keys), frozenset(keys))
            continue
        defaults = tuple(model.model_fields[k].default if k in model.model_fields else None for k in keys)
        out[path] = Selector(tuple(keys), defaults, frozenset(model.model_fields))
    return out


# ---------------------------------------------------------------------------------------------
# YAML files and `defaults:`
# ---------------------------------------------------------------------------------------------
def _key_lines(node: Any, path: Path_, out: dict[Path_, int]) -> None:
    """Line (1-based) of each key of a composed YAML document, by its path."""
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is None or key == "<<":
                continue
            here = path + (int(key) if k.tag.endswith(":int") else key,)
            out.setdefault(here, k.start_mark.line + 1)
            _key_lines(v, here, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.setdefault(path + (i,), v.start_mark.line + 1)
            _key_lines(v, path + (i,), out)


def _read_yaml(path: Path) -> tuple[dict, dict[Path_, int]]:
    """The file's mapping and the line of each of its keys."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    finally:
        loader.dispose()
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    lines: dict[Path_, int] = {}
    _key_lines(node, (), lines)
    return data, lines


def _merge(base: dict, top: dict, selectors: dict[Path_, Selector], path: Path_ = ()) -> dict:
    """``top`` over ``base``: mappings merge key by key (lists and values replace), and a section whose
    selecting key changes keeps only what ``Selector.rebase`` leaves of the parent's."""
    sel = selectors.get(path)
    out = dict(sel.rebase(base, top) if sel is not None else base)
    for k, v in top.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _merge(out[k], v, selectors, path + (k,)) if both else v
    return out


def _load(path: Path, selectors: dict[Path_, Selector], seen: tuple) -> tuple[dict, dict[Path_, Origin]]:
    if path in seen:
        raise ConfigError(f"{path}: `defaults` cycle through {' -> '.join(map(str, seen))}")
    data, lines = _read_yaml(path)
    defaults = data.pop("defaults", None) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged: dict = {}
    origins: dict[Path_, Origin] = {}
    for d in defaults:
        parent, parent_origins = _load((path.parent / d).resolve(), selectors, seen + (path,))
        merged = _merge(merged, parent, selectors)
        origins |= parent_origins
    merged = _merge(merged, data, selectors)
    origins |= {p: Origin(str(path), lines.get(p)) for p, _ in walk_keys(data, ())}
    present = {p for p, _ in walk_keys(merged, ())}  # a replaced section's or dropped option's keys are gone
    return merged, {p: o for p, o in origins.items() if p in present}


def load_yaml_with_provenance(path: str | Path, schema: type[BaseModel] | None = None,
                              selecting: dict[str, tuple[str, ...]] | None = None) -> tuple[dict, Provenance]:
    """The file merged over the files its ``defaults:`` (a name or a list, relative to it) names, in
    order, with the origin of every key. With ``schema``, sections whose selecting key changes are
    replaced as ``Selector`` says (``selecting``: see ``selectors_of``); without, a plain merge."""
    path = Path(path).resolve()
    selectors = selectors_of(schema, selecting) if schema is not None else {}
    data, origins = _load(path, selectors, ())
    return data, Provenance(str(path), origins)


def load_yaml_with_defaults(path: str | Path, schema: type[BaseModel] | None = None,
                            selecting: dict[str, tuple[str, ...]] | None = None) -> dict:
    """``load_yaml_with_provenance`` without the origins."""
    return load_yaml_with_provenance(path, schema, selecting)[0]


# ---------------------------------------------------------------------------------------------
# Overrides and the command line
# ---------------------------------------------------------------------------------------------
def _parse_override(ov: str) -> tuple[bool, list[str], Any]:
    force = ov.startswith("++")
    body = ov[2:] if force else ov
    if "=" not in body:
        raise ConfigError(f"override {ov!r}: expected key=value")
    key, raw = body.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return force, key.strip().split("."), value


def apply_overrides(cfg: dict, overrides: list[str], schema: type[BaseModel], provenance: Provenance | None = None,
                    selecting: dict[str, tuple[str, ...]] | None = None) -> dict:
    """`a.b=value` sets a key that the YAML or ``schema`` knows; `++a.b=value` may add any key. Values
    are parsed as YAML (`3` int, `true` bool, `null` None, `[1,2]` list). An override of a selecting key
    (``data.train.generator.kind=...``) applies first and drops what the parent's selection owned, as a
    child file's would; the other overrides then fill the section in, whatever their order."""
    selectors = selectors_of(schema, selecting)
    parsed = [(ov, *_parse_override(ov)) for ov in overrides]

    def selects(parts: list[str]) -> Selector | None:
        sel = selectors.get(tuple(parts[:-1]))
        return sel if sel is not None and parts[-1] in sel.keys else None

    ordered = [p for p in parsed if selects(p[2])] + [p for p in parsed if not selects(p[2])]
    for ov, force, parts, value in ordered:
        key = ".".join(parts)
        node = cfg
        for i, k in enumerate(parts[:-1]):
            if not isinstance(node.get(k), dict):
                if k in node and node[k] is not None and not force:
                    raise ConfigError(f"override {ov!r}: {'.'.join(parts[:i + 1])} is not a mapping")
                node[k] = {}
            node = node[k]
        present = parts[-1] in node
        if not (present or force or schema_has(parts, schema)):
            close = difflib.get_close_matches(parts[-1], list(node) + _schema_fields(parts[:-1], schema), n=1)
            hint = f" (did you mean {'.'.join(parts[:-1] + close)}?)" if close else ""
            raise ConfigError(f"override {ov!r}: unknown config key {key!r}{hint}; use ++{key}=... to add it")
        if (sel := selects(parts)) is not None:
            kept = sel.rebase(node, {parts[-1]: value})
            if kept is not node:
                node.clear()
                node.update(kept)
        node[parts[-1]] = value
        if provenance is not None:
            provenance.mark(tuple(parts), value, Origin(None))
            provenance.keep_only(cfg)
    return cfg


IMPORT_PREFIX = "imports+="


def with_imports(raw: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """``imports+=my_pkg.envs`` overrides (the CLI's ``--import``) appended to the YAML's ``imports:``
    list, which the config imports first when it is validated; returns the other overrides."""
    extra = [o.removeprefix(IMPORT_PREFIX) for o in overrides if o.startswith(IMPORT_PREFIX)]
    if extra:
        raw = dict(raw, imports=list(raw.get("imports") or []) + extra)
    return raw, [o for o in overrides if not o.startswith(IMPORT_PREFIX)]


def parse_cli(argv: list[str], default_config: str | Path) -> tuple[str, list[str]]:
    """`[--config PATH] [--import MODULE ...] [key=value ...]` -> (config path, overrides); each
    ``--import m`` is an ``imports+=m`` entry of the overrides (see ``with_imports``)."""
    path, overrides, i = str(default_config), [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "--import"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{a} needs a {'path' if a == '--config' else 'module name'}")
            if a == "--config":
                path = argv[i + 1]
            else:
                overrides += [IMPORT_PREFIX + m for m in argv[i + 1].split(",") if m.strip()]
            i += 2
            continue
        if a.startswith("--import="):
            overrides += [IMPORT_PREFIX + m for m in a.split("=", 1)[1].split(",") if m.strip()]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a in ("-h", "--help"):  # asked for, so printed to stdout with success, as argparse does
            print("usage: [--config PATH] [--import MODULE ...] [key=value | ++key=value ...]  "
                  f"(default: {default_config})\nEvery key and its default: docs/reference/config.md")
            raise SystemExit(0)
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(f"unexpected argument {a!r}: expected --config PATH or key=value")
        i += 1
    return path, overrides
