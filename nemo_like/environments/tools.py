"""A registry of tools the policy may call: plain Python callables with a name, a description and a
JSON-schema ``parameters`` object, rendered in the OpenAI/Hugging Face "tools" format.

Register with the decorator (schema derived from type hints and the docstring)::

    @tool()
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number
            b: the second number
        \"\"\"
        return a + b

or explicitly with :func:`register_tool` (any callable, any JSON schema). :func:`tool_schemas`
gives the list to pass as ``tokenizer.apply_chat_template(messages, tools=...)``.

Supported hint types: ``int`` ("integer"), ``float`` ("number"), ``str`` ("string"), ``bool``
("boolean"), ``list``/``list[T]`` ("array"), ``dict`` ("object") and ``Optional[T]``. Parameters with
a default are optional. :func:`validate_arguments` checks a call's arguments against a schema (the
subset of JSON schema used here: type, enum, properties, required, additionalProperties, items,
minimum, maximum, maxLength, maxItems) and never raises.

Import-light on purpose (standard library only): the tool environment runs inside a Ray actor and
this module is imported there.
"""

from __future__ import annotations

import inspect
import json
import random
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Re-exported: callers check a call's arguments with `tools.validate_arguments`.
from nemo_like.environments.tool_schema import MAX_SCHEMA_DEPTH, validate_arguments  # noqa: F401
from nemo_like.utils.registry import Registry, import_from_path

__all__ = [
    "TOOL_REGISTRY",
    "Tool",
    "tool",
    "register_tool",
    "unregister_tool",
    "get_tool",
    "registered_tools",
    "tool_schemas",
    "derive_parameters",
    "validate_arguments",
    "resolve_tool",
    "LOOKUP_TABLE",
    "PRICES",
    "POPULATIONS",
    "DEFAULT_TOOLS",
]

# OpenAI's rule for function names; HF chat templates and most parsers assume it too.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


@dataclass(frozen=True)
class Tool:
    """One registered tool. ``fn(**arguments)`` runs it; ``schema()`` is its "tools" entry."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(compare=False, repr=False)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": json.loads(json.dumps(self.parameters)),  # a copy callers may mutate
            },
        }


def _check_tool(name: str, obj: Any) -> None:
    if not isinstance(obj, Tool):
        raise TypeError(f"tool {name!r}: expected a Tool (use register_tool), got {type(obj).__name__}")
    if obj.name != name:
        raise ValueError(f"tool {name!r}: the Tool is named {obj.name!r}; register it under its own name")


# Tests keep their tools local with ``with TOOL_REGISTRY.isolated(): ...``.
TOOL_REGISTRY: Registry[Tool] = Registry("tool", check=_check_tool)


# --------------------------------------------------------------------------- schema derivation
_SIMPLE_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean",
                                 list: "array", dict: "object", type(None): "null"}


def _hint_schema(hint: Any, where: str) -> dict[str, Any]:
    if hint in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1 and len(args) == 2:  # Optional[T]
            inner = _hint_schema(non_null[0], where)
            if "type" in inner and isinstance(inner["type"], str):
                return {**inner, "type": [inner["type"], "null"]}
        raise TypeError(f"{where}: unsupported union type {hint!r} (only Optional[T] is supported)")
    if origin is list:
        if not args:
            return {"type": "array"}
        return {"type": "array", "items": _hint_schema(args[0], where)}
    if origin is dict:
        return {"type": "object"}
    raise TypeError(
        f"{where}: unsupported type hint {hint!r}; use int, float, str, bool, list, list[T], dict or Optional[T]"
    )


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style ("Args:") or Sphinx (":param x:") docstring.

    The description is the docstring's first paragraph, joined into one line.
    """
    if not doc:
        return "", {}
    desc_lines: list[str] = []
    params: dict[str, str] = {}
    section = "desc"
    current: str | None = None
    args_indent: int | None = None
    for raw in inspect.cleandoc(doc).splitlines():
        line = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        m = _SPHINX_PARAM_RE.match(line)
        if m:
            section, current = "sphinx", m.group(1)
            params[current] = m.group(2).strip()
            continue
        if _ARGS_HEADER_RE.match(line):
            section, current, args_indent = "args", None, None
            continue
        if _OTHER_HEADER_RE.match(line) or line.startswith(":return") or line.startswith(":raises"):
            section, current = "other", None
            continue
        if section == "desc":
            if line:
                desc_lines.append(line)
            elif desc_lines:
                section = "after_desc"
        elif section == "args" and line:
            if args_indent is None:
                args_indent = indent
            m = _GOOGLE_PARAM_RE.match(line)
            if m and indent <= args_indent:
                current = m.group(1).lstrip("*")
                params[current] = m.group(2).strip()
            elif current:
                params[current] = f"{params[current]} {line}".strip()
        elif section == "sphinx" and line and current:
            params[current] = f"{params[current]} {line}".strip()
    return " ".join(desc_lines), params


_SPHINX_PARAM_RE = re.compile(r"^:param\s+(?:[\w\[\], ]+\s+)?(\w+)\s*:\s*(.*)$")
_ARGS_HEADER_RE = re.compile(r"^(Args|Arguments|Parameters)\s*:\s*$")
_OTHER_HEADER_RE = re.compile(r"^(Returns?|Raises|Yields|Examples?|Notes?|Warnings?)\s*:\s*$")
_GOOGLE_PARAM_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def derive_parameters(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """(description, JSON-schema parameters) of ``fn`` from its signature, type hints and docstring.

    Every parameter needs a supported type hint; parameters without a default are required; extra
    arguments are rejected (``additionalProperties: false``). ``*args``/``**kwargs``, positional-only
    parameters and unsupported hints raise TypeError naming the function and parameter.
    """
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"tool {label}: cannot read its signature ({e})") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise TypeError(f"tool {label}: cannot resolve its type hints ({type(e).__name__}: {e})") from None
    description, param_docs = _parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, p in sig.parameters.items():
        where = f"tool {label}, parameter {name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{where}: *args/**kwargs cannot be described by a JSON schema")
        if p.kind is p.POSITIONAL_ONLY:
            raise TypeError(f"{where}: positional-only parameters cannot be passed by name")
        if name not in hints:
            raise TypeError(f"{where}: missing type hint (needed to derive the JSON schema)")
        prop = _hint_schema(hints[name], where)
        if param_docs.get(name):
            prop["description"] = param_docs[name]
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    params: dict[str, Any] = {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False}
    return description, params


# ------------------------------------------------------------------------------- registration
def _check_schema(schema: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where}: schema nested deeper than {MAX_SCHEMA_DEPTH}")
    if not isinstance(schema, dict):
        raise TypeError(f"{where}: a schema must be a dict, got {type(schema).__name__}")
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        bad = [x for x in ts if x not in _JSON_TYPES]
        if bad or not ts:
            raise ValueError(f"{where}: unknown JSON-schema type {t!r} (use {list(_JSON_TYPES)})")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise TypeError(f"{where}: 'properties' must be a dict")
        for k, v in props.items():
            _check_schema(v, f"{where}.properties.{k}", depth + 1)
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise TypeError(f"{where}: 'required' must be a list of strings")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items", depth + 1)
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise TypeError(f"{where}: 'enum' must be a list")


def _check_parameters_fit(fn: Callable[..., Any], name: str, parameters: dict[str, Any]) -> None:
    """Every schema property must be accepted by ``fn`` and every required fn parameter be in the schema."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    ps = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in ps.values()):
        return
    names = {n for n, p in ps.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    props = set((parameters.get("properties") or {}).keys())
    unknown = sorted(props - names)
    if unknown:
        raise ValueError(f"tool {name!r}: schema properties {unknown} are not parameters of the function")
    needed = sorted(n for n in names if ps[n].default is ps[n].empty and n not in props)
    if needed:
        raise ValueError(f"tool {name!r}: required function parameters {needed} are missing from the schema")


def register_tool(
    fn: Callable[..., Any],
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Tool:
    """Register ``fn`` as a tool and return its :class:`Tool`.

    ``name`` defaults to ``fn.__name__``, ``description`` to the docstring's first paragraph and
    ``parameters`` to the schema derived from the type hints (:func:`derive_parameters`). An explicit
    ``parameters`` must be an object schema whose properties the function accepts. Registering the
    same function again under its name is a no-op; a different function needs ``overwrite=True``
    (silently swapping a tool would change what the policy is rewarded for).
    """
    if not callable(fn):
        raise TypeError(f"register_tool: expected a callable, got {type(fn).__name__}")
    name = name if name is not None else getattr(fn, "__name__", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"tool name must match {_NAME_RE.pattern} (letters, digits, '_', '-'), got {name!r}")
    if parameters is None:
        derived_desc, parameters = derive_parameters(fn)
        if description is None:
            description = derived_desc
    else:
        _check_schema(parameters, f"tool {name!r} parameters")
        if parameters.get("type") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema with \"type\": \"object\"")
        _check_parameters_fit(fn, name, parameters)
        parameters = json.loads(json.dumps(parameters))  # a private copy; also proves it is JSON
        if description is None:
            description = _parse_docstring(inspect.getdoc(fn))[0]
    if not isinstance(description, str):
        raise TypeError(f"tool {name!r}: description must be a string, got {type(description).__name__}")
    new = Tool(name=name, description=description, parameters=parameters, fn=fn)
    # Tools compare by name, description and schema only, so the registry alone would take another
    # function with the same schema for "the same again": the function is checked here.
    old = TOOL_REGISTRY.get(name) if name in TOOL_REGISTRY else None
    if old is not None and not overwrite and old.fn is not fn:
        raise ValueError(
            f"tool {name!r} is already registered (to {getattr(old.fn, '__qualname__', old.fn)!r}); "
            "pass overwrite=True to replace it"
        )
    TOOL_REGISTRY.register(name, new, overwrite=overwrite)
    return new


def tool(
    name: str | Callable[..., Any] | None = None, description: str | None = None, *, overwrite: bool = False
) -> Any:
    """Decorator registering a function as a tool (schema from its type hints and docstring).

    ``@tool()``, ``@tool(name="sum", description="...")`` or bare ``@tool``. The function is returned
    unchanged, with its :class:`Tool` as ``fn.__tool__``.
    """
    if callable(name):  # bare @tool
        fn = name
        fn.__tool__ = register_tool(fn, overwrite=overwrite)  # type: ignore[attr-defined]
        return fn

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__tool__ = register_tool(fn, name, description, overwrite=overwrite)  # type: ignore[attr-defined]
        return fn

    return decorator


def unregister_tool(name: str) -> None:
    """Remove a tool (no error if absent); mostly for tests."""
    TOOL_REGISTRY.unregister(name)


def registered_tools() -> list[str]:
    """Sorted names of all registered tools."""
    return TOOL_REGISTRY.names()


def get_tool(name: str) -> Tool:
    if not isinstance(name, str) or not name:  # a name parsed from a model's output may be anything
        raise KeyError(f"unknown tool {name!r}; registered: {registered_tools()}")
    return TOOL_REGISTRY.get(name)


def resolve_tool(spec: str) -> Tool:
    """A tool by registered name, or by import path ``"pkg.mod.fn"``/``"pkg.mod:fn"``.

    An import path imports the module (whose ``@tool`` decorators register its tools, also inside a Ray
    actor that never ran the driver's registrations) and returns the function's tool, registering it
    with a derived schema if it was not decorated.
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"a tool must be named by a non-empty string, got {spec!r}")
    if spec in TOOL_REGISTRY or ("." not in spec and ":" not in spec):
        return get_tool(spec)
    try:
        fn = import_from_path(spec, what="tool")
    except (ImportError, ValueError) as e:
        raise KeyError(f"unknown tool {spec!r}: not a registered name and not importable ({e})") from None
    existing = getattr(fn, "__tool__", None)
    if isinstance(existing, Tool):
        return existing
    same = [t for _, t in TOOL_REGISTRY.items() if t.fn is fn]
    if same:  # registered explicitly (register_tool), perhaps under another name or schema
        return same[0]
    return register_tool(fn)


def tool_schemas(names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The "tools" list (``{"type": "function", "function": {name, description, parameters}}``) for
    ``names`` in the given order (None: every registered tool, sorted by name)."""
    if isinstance(names, str):
        names = [names]
    return [get_tool(n).schema() for n in (registered_tools() if names is None else names)]


# ------------------------------------------------------------------------------ built-in tools
# A fictional table (prices of items, populations of made-up towns) so that answers can only come
# from calling the tool. A few hand-written entries, then a few hundred generated pseudo-words: with
# only a handful of keys a small model memorises question -> key instead of learning to copy the key,
# and a held-out key is then never called right.
PRICES: dict[str, int] = {
    "apple": 3, "pear": 5, "plum": 2, "fig": 7, "kiwi": 4, "lime": 6, "melon": 9, "grape": 8,
    "bread": 12, "milk": 11, "egg": 1, "tea": 14, "rice": 13, "salt": 10, "jam": 15, "corn": 16,
}
POPULATIONS: dict[str, int] = {
    "zorb": 4120, "quil": 987, "vand": 2305, "mirk": 7781, "teph": 652, "dral": 3390, "oskin": 1450,
    "brell": 5012, "yarn": 8264, "pox": 319, "glim": 6048, "huxa": 2777, "wend": 1096, "krat": 9433,
    "lumo": 505, "fenn": 7120,
}
NUM_GENERATED_KEYS = 300  # per table


def _generate_entries(taken: set[str], n: int, low: int, high: int, salt: str) -> dict[str, int]:
    """``n`` new pseudo-words (two or three consonant-vowel syllables, fixed by ``salt``) -> values."""
    rng = random.Random(f"nemo_like-lookup-{salt}")
    out: dict[str, int] = {}
    while len(out) < n:
        word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3))))
        if word not in taken and word not in out:
            out[word] = rng.randint(low, high)
    return out


PRICES.update(_generate_entries(set(PRICES) | set(POPULATIONS), NUM_GENERATED_KEYS, 1, 99, "prices"))
POPULATIONS.update(_generate_entries(set(PRICES) | set(POPULATIONS), NUM_GENERATED_KEYS, 100, 9999, "towns"))
LOOKUP_TABLE: dict[str, int] = {**PRICES, **POPULATIONS}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def lookup(key: str) -> int:
    """Look up the value stored under a key (an item's price or a city's population).

    Args:
        key: the item or city name, lowercase
    """
    if key not in LOOKUP_TABLE:
        raise KeyError(f"no entry for {key[:40]!r}")
    return LOOKUP_TABLE[key]


# Bounded integers: the arithmetic stays cheap and results stay short whatever the policy asks.
_INT_BOUND = 10**9
_INT2 = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "description": "the first number", "minimum": -_INT_BOUND, "maximum": _INT_BOUND},
        "b": {"type": "integer", "description": "the second number", "minimum": -_INT_BOUND, "maximum": _INT_BOUND},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
register_tool(add, parameters=_INT2)
register_tool(mul, parameters=_INT2)
register_tool(lookup)  # derived from the hints and docstring
DEFAULT_TOOLS: tuple[str, ...] = ("add", "mul", "lookup")
