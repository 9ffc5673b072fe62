"""Typed options of registered components, checked with the rest of the config.

A registered policy loss, loss, advantage estimator or generation backend may declare a pydantic
model of its own options (``register_policy_loss("sapo", fn, options=SapoOptions)``). Its options
are then keys of the config section that names it, written flat beside the section's own keys:
``loss_fn.tau`` for a policy loss or loss, ``grpo.<key>`` for an estimator, ``policy.generation.<key>``
for a generation backend (an environment's are ``env.<name>.*``, declared as its ``config_model``).
Such a section accepts keys it does not know, and :func:`apply_registered_options` checks them
against the options of what the section selects, when the config is validated (before Ray starts):
an unknown key or a bad value is an error naming the section's key with a did-you-mean; the values
are replaced by the validated ones (defaults filled in, types coerced), so the component reads
``config.tau`` as a typed value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from nemo_like.utils.registry import Registry

__all__ = ["apply_registered_options", "format_option_errors"]


def format_option_errors(prefix: str, e: ValidationError, known: Iterable[str]) -> str:
    """One line naming each bad key as ``<prefix>.<key>``; an unknown key gets the closest of
    ``known`` as a did-you-mean (or the list of allowed keys)."""
    known = sorted(set(known))
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        key = f"{prefix}.{loc}" if loc else prefix
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            hint = f" (did you mean {prefix}.{close[0]}?)" if close else f" (allowed: {', '.join(known)})"
            parts.append(f"{key}: unknown config key{hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if "input" in err and err["type"] != "missing" and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def apply_registered_options(section: BaseModel, prefix: str,
                             selected: Sequence[tuple[Registry[Any], str]]) -> None:
    """Check the keys ``section`` does not define (its pydantic extras) against the options models
    registered for ``selected`` (``(registry, name)`` pairs: what the section picks), and put the
    validated values back. ``prefix`` is the section's place in the config (``"loss_fn"``) for the
    messages. Raises ValueError naming the key; a name that is not registered is left to the
    section's own name check."""
    extras: dict[str, Any] = dict(section.model_extra or {})
    own = set(type(section).model_fields)
    models: list[tuple[str, type[BaseModel]]] = []
    for registry, name in selected:
        if name not in registry:
            continue
        model = registry.options(name)
        if model is None:
            continue
        if clash := sorted(own & set(model.model_fields)):
            raise ValueError(f"{prefix}: the options of {registry.kind} {name!r} redefine {clash}, keys "
                             f"{prefix} already has; rename them in its options model")
        models.append((f"{registry.kind} {name!r}", model))
    known = own | {f for _, m in models for f in m.model_fields}
    if unknown := sorted(set(extras) - known):
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {prefix}.{close[0]}?)" if close else ""
        why = "" if models else f" ({' and '.join(f'{r.kind} {n!r}' for r, n in selected)}: no options of their own)"
        raise ValueError(f"{prefix}.{unknown[0]}: unknown config key{hint}{why}")
    validated: dict[str, Any] = {}
    for what, model in models:
        try:
            validated.update(model.model_validate({k: v for k, v in extras.items() if k in model.model_fields})
                             .model_dump())
        except ValidationError as e:
            raise ValueError(f"{format_option_errors(prefix, e, known)} (an option of {what})") from None
    assert section.__pydantic_extra__ is not None
    section.__pydantic_extra__.clear()
    section.__pydantic_extra__.update(validated)
