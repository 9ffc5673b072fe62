"""The tool-call wire format: the strict parser, the formatters and final-answer grading.

Conversation protocol (Hermes/Qwen convention). The assistant calls tools with one or more blocks

    <tool_call>{"name": "mul", "arguments": {"a": 37, "b": 4}}</tool_call>

and the environment answers with one ``{"role": "tool", "content": ...}`` message holding one
``<tool_response>RESULT</tool_response>`` per call, in call order, joined by newlines, where RESULT
is the tool's return value as compact JSON (``148``, ``"text"``) or ``{"error": "..."}``. An
assistant message without any ``<tool_call>`` is the final answer and ends the episode.

The parser is part of the reward spec, so it is strict: every block must be closed, hold exactly one
JSON object with a string ``name`` and an object ``arguments`` (no other keys, no duplicate keys, no
NaN/Infinity), and a message with any malformed block runs none of its calls (an error observation
instead; the episode continues until ``max_turns``). Parsing is linear in the message length and
refuses messages, blocks, nesting and call counts over fixed limits, so hostile text costs nothing.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "RESPONSE_OPEN",
    "RESPONSE_CLOSE",
    "TOOL_STOP_STRINGS",
    "parse_tool_calls",
    "format_tool_call",
    "format_tool_response",
    "extract_tool_answer",
    "answers_match",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_STOP_STRINGS = [TOOL_CALL_CLOSE]  # generation stops right after a call

MAX_MESSAGE_CHARS = 65_536  # a longer assistant message is malformed (parser bound)
MAX_CALL_CHARS = 8_192  # one <tool_call> block's JSON
MAX_JSON_DEPTH = 32  # brackets nested deeper than this are rejected before json.loads
MAX_ANSWER_CHARS = 200  # longer final answers score 0 (this also bounds the comparison)
MAX_ERROR_CHARS = 200  # error texts shown to the policy
MAX_RECORDED_CALLS = 64  # per-episode call record kept in the metadata


# ------------------------------------------------------------------------------------- parser
class _Reject(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _Reject(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Reject(f"duplicate key {k[:40]!r}")
        out[k] = v
    return out


def _max_depth(s: str, limit: int) -> bool:
    """True if brackets (outside JSON strings) nest at most ``limit`` deep. Linear, no recursion."""
    depth, in_str, esc = 0, False, False
    for c in s:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return False
        elif c in "]}":
            depth -= 1
    return True


def _parse_one(body: str, index: int) -> dict[str, Any]:
    where = f"tool call {index + 1}"
    body = body.strip()
    if not body:
        raise _Reject(f"{where} is empty")
    if len(body) > MAX_CALL_CHARS:
        raise _Reject(f"{where} is longer than {MAX_CALL_CHARS} characters")
    if not _max_depth(body, MAX_JSON_DEPTH):
        raise _Reject(f"{where} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(body, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _Reject as e:
        raise _Reject(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise _Reject(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer over Python's digit limit
        raise _Reject(f"{where} is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise _Reject(f"{where} must be a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise _Reject(f"{where} has unexpected keys {[k[:40] for k in extra[:3]]} (only name and arguments)")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _Reject(f"{where}: 'name' must be a non-empty string")
    if "arguments" not in obj:
        raise _Reject(f"{where}: missing 'arguments' (use {{}} for none)")
    if not isinstance(obj["arguments"], dict):
        raise _Reject(f"{where}: 'arguments' must be a JSON object, got {type(obj['arguments']).__name__}")
    return {"name": name, "arguments": obj["arguments"]}


def parse_tool_calls(text: Any, *, max_calls: int = 8, max_chars: int = MAX_MESSAGE_CHARS) -> tuple[list[dict], str | None]:
    """The tool calls in an assistant message: ``([{"name": str, "arguments": dict}, ...], None)``.

    ``([], None)``: the message has no ``<tool_call>`` (it is a final answer). ``([], "reason")``: the
    message tries to call tools but is malformed (unclosed or stray tags, a block nested in a block,
    bad JSON, a non-string name, non-object arguments, other keys, duplicate keys, NaN, more than
    ``max_calls`` calls, more than ``max_chars`` characters); all-or-nothing, so no call of a malformed
    message runs. Never raises; time linear in ``len(text)`` (and nothing at all past ``max_chars``).
    """
    try:
        if not isinstance(text, str):
            return [], f"message content is a {type(text).__name__}, not a string"
        if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
            return [], None
        if len(text) > max_chars:
            return [], f"message is longer than {max_chars} characters"
        calls: list[dict] = []
        pos = 0
        while True:
            i = text.find(TOOL_CALL_OPEN, pos)
            stray = text.find(TOOL_CALL_CLOSE, pos)
            if i < 0:
                if stray >= 0:
                    raise _Reject(f"'{TOOL_CALL_CLOSE}' without a matching '{TOOL_CALL_OPEN}'")
                break
            if 0 <= stray < i:
                raise _Reject(f"'{TOOL_CALL_CLOSE}' without a matching '{TOOL_CALL_OPEN}'")
            start = i + len(TOOL_CALL_OPEN)
            j = stray if stray >= start else text.find(TOOL_CALL_CLOSE, start)
            if j < 0:
                raise _Reject(f"tool call {len(calls) + 1} is not closed with '{TOOL_CALL_CLOSE}'")
            body = text[start:j]
            if TOOL_CALL_OPEN in body:
                raise _Reject(f"tool call {len(calls) + 1} is not closed before the next '{TOOL_CALL_OPEN}'")
            if len(calls) >= max_calls:
                raise _Reject(f"more than {max_calls} tool calls in one message")
            calls.append(_parse_one(body, len(calls)))
            pos = j + len(TOOL_CALL_CLOSE)
        return calls, None
    except _Reject as e:
        return [], str(e)[:MAX_ERROR_CHARS]
    except Exception as e:  # last line of defence (MemoryError...): never raise into the trainer
        return [], f"tool calls could not be parsed ({type(e).__name__})"


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical compact text of one call: ``<tool_call>{"name":"mul","arguments":{"a":37,"b":4}}</tool_call>``."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def format_tool_response(result: Any = None, *, error: str | None = None) -> str:
    """One ``<tool_response>`` block: the result as compact JSON, or ``{"error": "..."}``."""
    payload = compact_json({"error": error[:MAX_ERROR_CHARS]}) if error is not None else compact_json(result)
    return f"{RESPONSE_OPEN}{payload}{RESPONSE_CLOSE}"


def canonical_call(call: Any) -> str | None:
    """Key for exact name+arguments matching: JSON types matter (4 != 4.0 != true), key order does not."""
    try:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            return None
        return json.dumps([call["name"], args], sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


# ------------------------------------------------------------------------------- final answer
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_TRAILING_SPECIAL_RE = re.compile(r"(?:\s*<\|[A-Za-z0-9_]{1,30}\|>)+\s*$")


def extract_tool_answer(text: str) -> str | None:
    """The final answer of an assistant message: the content of the last ``\\boxed{...}`` if the
    message has one (balanced braces; None if that last box is unclosed or longer than
    MAX_ANSWER_CHARS), else the whole message stripped (trailing chat special tokens such as
    ``<|im_end|>`` removed). Linear time."""
    pos = len(text)
    while (i := text.rfind("\\boxed", 0, pos)) >= 0:
        m = _BOXED_RE.match(text, i)
        if m:
            depth, k, end = 1, m.end(), min(len(text), m.end() + MAX_ANSWER_CHARS + 1)
            while k < end:
                c = text[k]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[m.end() : k]
                k += 1
            return None
        pos = i
    tail = text[-(MAX_ANSWER_CHARS + 1000) :] if len(text) > MAX_ANSWER_CHARS + 1000 else text
    return _TRAILING_SPECIAL_RE.sub("", tail).strip()


_NUMBER_RE = re.compile(r"^[+-]?(?:\d{1,60}(?:\.\d{0,60})?|\.\d{1,60})$")


def _normalise(s: str) -> str:
    return " ".join(s.split())


def answers_match(answer: str | None, truth: str) -> bool:
    """Whitespace-normalised string equality; if both sides are plain decimal numbers (no exponent,
    at most 60 digits each side of the point), numeric equality (``148 == 148.0 == +148``)."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    a, t = _normalise(answer), _normalise(truth)
    if not a or not t:
        return False
    if a == t:
        return True
    if _NUMBER_RE.match(a) and _NUMBER_RE.match(t):
        return Fraction(a) == Fraction(t)
    return False
