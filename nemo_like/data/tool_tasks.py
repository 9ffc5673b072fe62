"""Procedurally generated tool-use tasks for the tiny char-level model, and their row processors.

Three kinds of question, each answered with exactly one tool call then a boxed answer::

    user       37*4=?
    assistant  <tool_call>{"name":"mul","arguments":{"a":37,"b":4}}</tool_call>
    tool       <tool_response>148</tool_response>
    assistant  \\boxed{148}

``add`` ("37+4=?"), ``mul`` ("37*4=?") and ``lookup`` ("price of apple?", "population of zorb?",
over the fictional table :data:`nemo_like.environments.tools.LOOKUP_TABLE`, 632 keys). Texts are as short
as the Hermes/Qwen tool-call convention allows: the whole reference conversation rendered with the
tiny ChatML template is about 150-170 character tokens (the call and response tags and chat markers
alone take ~120), so a model for this task needs ``max_position_embeddings`` >= 192.

Rows (an HF ``datasets.Dataset``): ``problem``, ``ground_truth`` (also as ``expected_answer``, the
column the math/SFT pipeline reads), ``expected_calls`` (JSON text of ``[{"name", "arguments"}]``),
``task_name`` ("tool"), ``kind`` and ``sft_messages`` (JSON text of the full reference conversation,
whose tool message is exactly what :class:`~nemo_like.environments.tool_environment.ToolEnvironment`
answers). Deterministic by seed; train and validation are disjoint (split by a stable hash of the
problem text, and for lookups of the key).

Processors (the ``DataProcessor`` protocol of :mod:`nemo_like.data.processors`):
:func:`tool_data_processor` (prompt only, for RL: first-turn stop string ``</tool_call>``, ground
truth and expected calls in ``extra_env_info``) and :func:`tool_sft_data_processor` (the whole
reference conversation, loss on the assistant turns only). Both accept ``tools=`` (bind with
``functools.partial``) to render the tool schemas through a chat template that supports them; the
tiny ChatML template does not, so for it put :func:`tool_system_prompt` in the system prompt instead.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from typing import Any, Literal

import datasets

from nemo_like.data.processors import make_datum_spec, prompt_chat, render_chat, tokenize_text
from nemo_like.environments.tool_environment import TOOL_STOP_STRINGS, format_tool_call, format_tool_response
from nemo_like.environments.tools import DEFAULT_TOOLS, LOOKUP_TABLE, PRICES, get_tool, tool_schemas

__all__ = [
    "TOOL_TASK_KINDS",
    "tool_task_split_of",
    "make_tool_task",
    "generate_tool_dataset",
    "tool_system_prompt",
    "tool_data_processor",
    "tool_sft_data_processor",
]

TOOL_TASK_KINDS = ("add", "mul", "lookup")
VALIDATION_PERCENT = 10  # share of the arithmetic questions held out
LOOKUP_VALIDATION_PERCENT = 25  # share of the (few) lookup keys held out
_ENUMERATION_LIMIT = 200_000


def _bucket(text: str) -> int:
    """A stable 0..99 bucket (sha256, not ``hash()``: that is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"nemo_like-tool:{text}".encode()).digest()[:8], "big") % 100


_LOOKUP_RE = re.compile(r"^(?:price|population) of (\w+)\?$")


def tool_task_split_of(problem: str) -> Literal["train", "validation"]:
    """The split a question belongs to, stable across processes. Lookup questions are split by their
    key (so a held-out key never appears in training), arithmetic ones by their text."""
    m = _LOOKUP_RE.match(problem)
    if m:
        return "validation" if _bucket(f"key:{m.group(1)}") < LOOKUP_VALIDATION_PERCENT else "train"
    return "validation" if _bucket(problem) < VALIDATION_PERCENT else "train"


def _question(kind: str, a: Any, b: Any = None) -> tuple[str, str, dict[str, Any]]:
    """(problem text, tool name, arguments)."""
    if kind == "add":
        return f"{a}+{b}=?", "add", {"a": a, "b": b}
    if kind == "mul":
        return f"{a}*{b}=?", "mul", {"a": a, "b": b}
    if kind == "lookup":
        what = "price" if a in PRICES else "population"
        return f"{what} of {a}?", "lookup", {"key": a}
    raise ValueError(f"unknown tool task kind {kind!r} (choose from {list(TOOL_TASK_KINDS)})")


def make_tool_task(kind: str, a: Any, b: Any = None) -> dict[str, Any]:
    """One row: the question, its reference tool call, the tool's real result and the answer.

    The result comes from running the registered tool, and the tool message from the environment's
    own formatter, so the reference conversation is exactly what the environment would produce.
    """
    problem, name, arguments = _question(kind, a, b)
    result = get_tool(name).fn(**arguments)
    answer = str(result)
    calls = [{"name": name, "arguments": arguments}]
    messages = [
        {"role": "user", "content": problem},
        {"role": "assistant", "content": format_tool_call(name, arguments)},
        {"role": "tool", "content": format_tool_response(result)},
        {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
    ]
    compact = {"separators": (",", ":")}
    return {
        "problem": problem,
        "ground_truth": answer,
        "expected_answer": answer,
        "expected_calls": json.dumps(calls, **compact),
        "task_name": "tool",
        "kind": kind,
        "sft_messages": json.dumps(messages, **compact),
    }


def _pool(kind: str, split: str, max_value: int, rng: random.Random, want: int) -> list[tuple]:
    """Distinct (a, b) of ``kind`` in ``split``, shuffled; at most ``want`` when the space is sampled."""
    if kind == "lookup":
        pool = [(k, None) for k in LOOKUP_TABLE if tool_task_split_of(_question("lookup", k)[0]) == split]
        rng.shuffle(pool)
        return pool
    space = (max_value + 1) ** 2
    if space <= _ENUMERATION_LIMIT:
        pool = [(a, b) for a in range(max_value + 1) for b in range(max_value + 1)
                if tool_task_split_of(_question(kind, a, b)[0]) == split]
        rng.shuffle(pool)
        return pool
    seen: set[tuple] = set()
    out: list[tuple] = []
    for _ in range(50 * want + 10_000):
        ab = (rng.randint(0, max_value), rng.randint(0, max_value))
        if ab in seen or tool_task_split_of(_question(kind, *ab)[0]) != split:
            continue
        seen.add(ab)
        out.append(ab)
        if len(out) == want:
            break
    return out


def generate_tool_dataset(
    split: Literal["train", "validation"],
    num_samples: int,
    seed: int,
    *,
    kinds: Sequence[str] = TOOL_TASK_KINDS,
    weights: Sequence[float] | None = None,
    max_value: int = 99,
) -> datasets.Dataset:
    """``num_samples`` rows of ``split``, deterministic by ``seed``.

    Each row's kind is drawn from ``kinds`` (with ``weights``, default uniform); questions of a kind
    are drawn without replacement and only repeat once that kind's share of the split is used up,
    which happens first for lookups (the table has 632 keys, about a quarter held out). Arithmetic
    operands are 0..``max_value``.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if isinstance(max_value, bool) or not isinstance(max_value, int) or not 1 <= max_value <= 10**6:
        raise ValueError(f"max_value must be an int in 1..1000000, got {max_value!r}")
    kinds = list(dict.fromkeys(kinds))
    bad = [k for k in kinds if k not in TOOL_TASK_KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds must be a non-empty subset of {list(TOOL_TASK_KINDS)}, got {list(kinds)!r}")
    if weights is None:
        weights = [1.0] * len(kinds)
    weights = list(weights)
    if len(weights) != len(kinds) or any(not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be {len(kinds)} non-negative numbers with a positive sum, got {weights!r}")
    rng = random.Random(f"nemo_like-tool-{seed}-{split}")
    chosen_kinds = rng.choices(kinds, weights=weights, k=num_samples)
    counts = {k: chosen_kinds.count(k) for k in kinds}
    pools = {k: _pool(k, split, max_value, rng, counts[k]) for k in kinds if counts[k]}
    empty = [k for k, p in pools.items() if not p]
    if empty:
        raise ValueError(f"tool tasks: no {split!r} questions of kind(s) {empty}; widen max_value or drop them")
    cursor = dict.fromkeys(pools, 0)
    rows = []
    for kind in chosen_kinds:
        pool = pools[kind]
        if cursor[kind] == len(pool):  # used up: go round again in a new order
            rng.shuffle(pool)
            cursor[kind] = 0
        rows.append(make_tool_task(kind, *pool[cursor[kind]]))
        cursor[kind] += 1
    return datasets.Dataset.from_list(rows)


def tool_system_prompt(tool_names: Sequence[str] | None = None, *, style: Literal["short", "hermes"] = "short") -> str:
    """A description of the tools for the system prompt, for templates that do not render ``tools``.

    ``"short"`` (for the tiny model): ``Tools: add(a:int,b:int) mul(a:int,b:int) lookup(key:str)``.
    ``"hermes"``: the JSON schemas in ``<tools></tools>`` plus the call format, as Qwen2.5 renders them.
    """
    names = list(DEFAULT_TOOLS if tool_names is None else tool_names)
    schemas = tool_schemas(names)
    if style == "hermes":
        listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )
    if style != "short":
        raise ValueError(f"style must be 'short' or 'hermes', got {style!r}")
    short = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "array": "list",
             "object": "dict"}
    parts = []
    for s in schemas:
        props = s["function"]["parameters"].get("properties", {})
        args = ",".join(f"{k}:{short.get(v.get('type'), v.get('type', 'any'))}" if isinstance(v.get("type"), str)
                        else k for k, v in props.items())
        parts.append(f"{s['function']['name']}({args})")
    return "Tools: " + " ".join(parts)


# --------------------------------------------------------------------------------- processors
def _env_info(datum: dict[str, Any], idx: int) -> dict[str, Any]:
    truth = datum.get("ground_truth", datum.get("expected_answer"))
    if truth is None:
        raise KeyError(f"row {idx} has no 'ground_truth' (or 'expected_answer') column (columns: {sorted(datum)})")
    info: dict[str, Any] = {"ground_truth": str(truth)}
    calls = datum.get("expected_calls")
    if calls is not None:
        info["expected_calls"] = json.loads(calls) if isinstance(calls, str) else calls
    return info




def _split_rendered(tokenizer: Any, chat: list[dict], tools: list[dict] | None) -> list[tuple[str, str]]:
    """(role, text) pieces of the rendered conversation, cut at message boundaries.

    The leading system/user messages form the prompt, which ends with the generation prompt of the
    first assistant turn; every later non-assistant message likewise carries the next turn's
    generation prompt, so each assistant piece is exactly what the model produces (content plus the
    template's end of turn) and nothing else.
    """
    first = next((k for k, msg in enumerate(chat) if msg["role"] == "assistant"), len(chat))
    ends = ([first] if first > 0 else []) + list(range(first + 1, len(chat) + 1))
    pieces: list[tuple[str, str]] = []
    done = ""
    for end in ends:
        next_is_assistant = end < len(chat) and chat[end]["role"] == "assistant"
        text = render_chat(tokenizer, chat[:end], add_generation_prompt=next_is_assistant, tools=tools)
        if not text.startswith(done):
            raise ValueError(
                "the chat template does not render a conversation as the concatenation of its turns, so "
                "assistant tokens cannot be separated for the loss"
            )
        pieces.append(("user" if end == first else chat[end - 1]["role"], text[len(done):]))
        done = text
    return pieces


def tool_data_processor(
    datum: dict[str, Any], task_data_spec: Any, tokenizer: Any, max_seq_length: int, idx: int,
    *, tools: list[dict] | None = None,
) -> dict[str, Any]:
    """A tool-task row -> prompt-only DatumSpec for RL (multi-turn rollouts).

    ``extra_env_info``: ``ground_truth`` and ``expected_calls``; ``stop_strings``: ``["</tool_call>"]``
    so the first turn stops right after a call, like the later turns the environment sets.
    """
    chat = prompt_chat(datum, task_data_spec, idx)
    text = render_chat(tokenizer, chat, add_generation_prompt=True, tools=tools)
    log = [{"role": "user", "content": text, "token_ids": tokenize_text(tokenizer, text)}]
    return make_datum_spec(log, max_seq_length=max_seq_length, extra_env_info=_env_info(datum, idx), idx=idx,
                           task_name=task_data_spec.task_name, stop_strings=list(TOOL_STOP_STRINGS))


def tool_sft_data_processor(
    datum: dict[str, Any], task_data_spec: Any, tokenizer: Any, max_seq_length: int, idx: int,
    *, tools: list[dict] | None = None,
) -> dict[str, Any]:
    """A tool-task row -> DatumSpec of its whole reference conversation (``sft_messages``) for SFT.

    The prompt comes from ``task_data_spec`` (system prompt, prompt format) and the problem, the rest
    from ``sft_messages``. Message roles are kept, so the SFT loss (assistant messages only) trains the
    call and the answer but never the tool response.
    """
    raw = datum.get("sft_messages")
    if raw is None:
        raise KeyError(f"row {idx} has no 'sft_messages' column (columns: {sorted(datum)})")
    messages = json.loads(raw) if isinstance(raw, str) else list(raw)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"row {idx}: sft_messages must be a list of {{role, content}} messages")
    first = next((k for k, m in enumerate(messages) if m["role"] not in ("system", "user")), len(messages))
    turns = messages[first:]
    if not turns or turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
        raise ValueError(f"row {idx}: sft_messages must continue the prompt with an assistant turn and end with one")
    chat = prompt_chat(datum, task_data_spec, idx) + [{"role": m["role"], "content": m["content"]} for m in turns]
    log = [{"role": role, "content": text, "token_ids": tokenize_text(tokenizer, text)}
           for role, text in _split_rendered(tokenizer, chat, tools)]
    return make_datum_spec(log, max_seq_length=max_seq_length, extra_env_info=_env_info(datum, idx), idx=idx,
                           task_name=task_data_spec.task_name)
