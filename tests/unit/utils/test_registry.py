"""The one registry shape: duplicates, lazy import paths, did-you-mean, validation, isolation."""

from __future__ import annotations

import sys

import pytest

from nemo_like.utils.registry import Registry


def _must_be_callable(name, obj):
    if not callable(obj):
        raise TypeError(f"thing {name!r}: {obj!r} is not callable")


def test_register_get_duplicates_and_did_you_mean():
    reg: Registry = Registry("thing", check=_must_be_callable, builtins={"sqrt": "math.sqrt"})

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double") is double and reg.get("sqrt")(9.0) == 3.0
    assert reg.names() == ["double", "sqrt"] and "double" in reg and "triple" not in reg
    reg.register("double", double)  # same target again: a no-op
    reg.register("sqrt", "math:sqrt")  # the same path spelled with a colon
    with pytest.raises(ValueError, match=r"thing 'double' is already registered to .*double; pass overwrite=True"):
        reg.register("double", lambda x: 3 * x)
    reg.register("double", abs, overwrite=True)
    assert reg.get("double") is abs
    with pytest.raises(KeyError, match=r"unknown thing 'dubble' \(did you mean 'double'\?\); registered: \['double', 'sqrt'\]"):
        reg.get("dubble")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", abs)
    with pytest.raises(TypeError, match="not callable"):
        reg.register("pi", 3.14)
    with pytest.raises(ValueError, match="must look like 'pkg.module.name'"):
        reg.register("bad", "nodots")


def test_import_paths_resolve_lazily_and_are_checked(tmp_path, monkeypatch):
    reg: Registry = Registry("thing", check=_must_be_callable)
    reg.register("later", "nl_registry_later_mod.fn")  # not importable yet: fine until asked for
    with pytest.raises(ImportError, match="nl_registry_later_mod"):
        reg.get("later")
    (tmp_path / "nl_registry_later_mod.py").write_text("def fn():\n    return 'later'\nNOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert reg.get("later")() == "later"
        assert reg.get("later") is reg.get("later")  # cached
        reg.register("const", "nl_registry_later_mod.NOT_CALLABLE")
        with pytest.raises(TypeError, match="not callable"):
            reg.get("const")
        reg.register("missing", "nl_registry_later_mod.nope")
        with pytest.raises(ImportError, match="has no attribute 'nope'"):
            reg.get("missing")
    finally:
        sys.modules.pop("nl_registry_later_mod", None)


def test_isolated_undoes_registrations():
    reg: Registry = Registry("thing")
    reg.register("kept", abs)
    with reg.isolated():
        reg.register("temporary", len)
        reg.register("kept", min, overwrite=True)
        assert reg.names() == ["kept", "temporary"]
    assert reg.names() == ["kept"] and reg.get("kept") is abs


def test_unnamed_targets_are_compared_by_value_not_by_type_name():
    reg: Registry = Registry("thing")
    reg.register("lam", lambda: 1)
    with pytest.raises(ValueError, match="already registered"):  # both are "<lambda>": still different
        reg.register("lam", lambda: 2)

    def make(k):
        def inner():
            return k

        return inner

    reg.register("closure", make(1))
    with pytest.raises(ValueError, match="already registered"):
        reg.register("closure", make(2))
    reg.register("pair", (abs, None))
    reg.register("pair", (abs, None))  # an equal tuple: a no-op
    with pytest.raises(ValueError, match="already registered"):
        reg.register("pair", (len, None))
    assert reg.get("pair") == (abs, None)
