"""Conversational prompts: a dataset column holding a list of chat messages (TRL's conversational
format, ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``) instead of a string.

The loaders (``datasets.py``) check every row with :func:`conversation_problem` and report the file and
line (JSONL) or the row (other sources); the processors (``processors.py``) render the messages through
the chat template as they are. Kept apart from both so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MESSAGE_ROLES", "conversation_problem", "is_conversation", "clean_conversation"]

# Roles a prompt conversation may hold. Tool and environment turns belong to rollouts, not to prompts.
MESSAGE_ROLES = ("system", "user", "assistant")


def is_conversation(value: Any) -> bool:
    """A prompt given as messages (any list or tuple; :func:`conversation_problem` says whether it is a
    well-formed one) rather than as text."""
    return isinstance(value, (list, tuple))


def conversation_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a prompt conversation, in words, or None when it is fine.

    A conversation is a non-empty list of mappings, each with a ``role`` (one of :data:`MESSAGE_ROLES`)
    and a string ``content``; a system message may only come first, and the last message is the user's
    (the model's completion answers it). Other keys of a message pass to the chat template unchecked.
    """
    if not is_conversation(value):
        return f"expected a list of messages, got {type(value).__name__}"
    if not value:
        return "the message list is empty"
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"message {i} is a {type(message).__name__}, not a {{\"role\": ..., \"content\": ...}} object"
        role = message.get("role")
        if role is None:
            return f"message {i} has no 'role' (one of {', '.join(MESSAGE_ROLES)})"
        if role not in MESSAGE_ROLES:
            return f"message {i} has role {role!r}; expected one of {', '.join(MESSAGE_ROLES)}"
        if message.get("content") is None:
            return f"message {i} ({role}) has no 'content'"
        if not isinstance(message["content"], str):
            return f"message {i} ({role}): 'content' must be a string, got {type(message['content']).__name__}"
        if role == "system" and i > 0:
            return f"message {i} is a system message; a system message may only come first"
    if value[-1]["role"] != "user":
        return (f"the last message is the {value[-1]['role']}'s; a prompt ends with the user's message (the "
                "model's completion answers it)")
    return None


def clean_conversation(value: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts without the keys a columnar format filled with None (a key one
    message of the file has and this one lacks). ValueError saying what is wrong when malformed."""
    if (problem := conversation_problem(value)) is not None:
        raise ValueError(problem)
    return [{k: v for k, v in m.items() if v is not None} for m in value]
