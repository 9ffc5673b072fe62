"""Sessions: one per agent episode, recording the exact tokens the engine sampled for it.

A session is reached through its own API key (``Authorization: Bearer <key>``), so an unmodified
harness needs only ``base_url`` and ``api_key``. Per request it records the prompt's token ids, the
sampled ids, their log-probs and the policy version that sampled them.

Token exactness: a chat request is rendered to text by the chat template, but its prompt ids are
built from what the session holds wherever possible:

* an assistant message the session produced (recognised by its tool-call ids, else by its content) is
  rendered with the exact text the engine sampled, not the text the harness sent back;
* when the rendered text starts with the previous request's prompt plus completion (decoded), the new
  prompt is those ids, token for token, plus the new text tokenized: the turns join into one sample
  (sampled tokens trained, the rest masked);
* otherwise (the harness dropped, summarised or rewrote history) the prompt is tokenized afresh and a
  new sample starts; ``prefix_breaks`` counts these. The episode's samples share its reward.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Turn:
    """One request of a session: its prompt ids, what was sampled, and how it joins the previous turn."""

    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    raw_text: str  # the sampled tokens decoded (special tokens skipped): how the reply is rendered back
    extends: bool  # the prompt is the previous turn's prompt + completion + new tokens
    call_ids: list[str] = field(default_factory=list)
    content: str | None = None


@dataclass
class Session:
    id: str
    key: str
    tag: Any = None  # the caller's (e.g. the episode's row index)
    greedy: bool = False  # every request decodes greedily (validation episodes)
    turns: list[Turn] = field(default_factory=list)
    prefix_breaks: int = 0
    malformed_tool_calls: int = 0
    reward: float | None = None
    ended: bool = False
    # Its episode is known to end with it: once it has asked, the batcher may wait for its next request
    # (SessionStore.running).
    awaited: bool = False
    asked: bool = False
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ---- replaying what this session sampled ---------------------------------------------------
    def replay_text(self, content: str, call_ids: list[str]) -> str | None:
        """The exact sampled text of a reply this session gave (by its tool-call ids, else its content)."""
        for t in reversed(self.turns):
            if call_ids and t.call_ids and call_ids[0] in t.call_ids:
                return t.raw_text
            if not call_ids and not t.call_ids and t.content is not None and t.content == content:
                return t.raw_text
        return None

    def prompt_ids(self, text: str, tokenizer: Any) -> tuple[list[int], bool]:
        """The prompt ids for rendered ``text``, and whether they extend the previous turn."""
        if self.turns:
            last = self.turns[-1]
            prev = last.prompt_ids + last.sampled_ids
            prev_text = tokenizer.decode(prev, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if text.startswith(prev_text):
                rest = text[len(prev_text):]
                return prev + (tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []), True
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), False

    def record(self, turn: Turn) -> None:
        if self.turns and not turn.extends:
            self.prefix_breaks += 1
        self.turns.append(turn)

    # ---- training samples ------------------------------------------------------------------------
    def samples(self, tokenizer: Any) -> list[list[dict[str, Any]]]:
        """The episode as message logs (one per run of joined turns): the first prompt as a ``user``
        message, each sampled turn as an ``assistant`` message with its ids, log-probs and version,
        the tokens between turns as ``tool`` messages (masked in training)."""
        logs: list[list[dict[str, Any]]] = []
        end = 0  # tokens of the current log so far
        for t in self.turns:
            if not t.extends or not logs:
                logs.append([_msg("user", t.prompt_ids, tokenizer)])
            else:
                between = t.prompt_ids[end:]
                if between:
                    logs[-1].append(_msg("tool", between, tokenizer))
            logs[-1].append(_msg("assistant", t.sampled_ids, tokenizer) | {
                "generation_logprobs": torch.tensor(t.logprobs, dtype=torch.float32),
                "policy_version": t.version})
            end = len(t.prompt_ids) + len(t.sampled_ids)
        return logs


def _msg(role: str, ids: list[int], tokenizer: Any) -> dict[str, Any]:
    return {"role": role, "content": tokenizer.decode(ids, skip_special_tokens=role == "assistant"),
            "token_ids": torch.tensor(ids, dtype=torch.long)}


class SessionStore:
    """Sessions by key. The server's own key (``api_key``) opens no session: its requests are recorded
    nowhere (chatting with or evaluating a model). Thread-safe: the trainer opens and ends sessions
    while the server's event loop serves them."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self._by_key: dict[str, Session] = {}
        self._ended: dict[str, str] = {}  # key -> session id, for a clear 410
        self._lock = threading.Lock()
        self._running = 0  # awaited sessions that have asked and not ended
        self._fresh: dict[str, Session] = {}  # awaited sessions that have not asked yet

    def open(self, tag: Any = None, *, awaited: bool = False) -> Session:
        """A new session; ``awaited``: its owner ends it the moment its episode ends, so until then the
        batcher may wait for its next request (``running``)."""
        s = Session(id=f"sess_{secrets.token_hex(8)}", key=f"sk-session-{secrets.token_urlsafe(24)}", tag=tag,
                    awaited=awaited)
        with self._lock:
            self._by_key[s.key] = s
            if awaited:
                self._fresh[s.key] = s
        return s

    def mark_asked(self, session: Session) -> None:
        """The session sent a request: from now on, until it ends, an awaited one counts as running."""
        with self._lock:
            if session.awaited and not session.asked and not session.ended:
                session.asked = True
                self._fresh.pop(session.key, None)
                self._running += 1

    def end(self, session: Session) -> Session:
        with self._lock:
            if not session.ended and session.asked:
                self._running -= 1
            session.ended = True
            self._by_key.pop(session.key, None)
            self._fresh.pop(session.key, None)
            self._ended[session.key] = session.id
            if len(self._ended) > 100_000:  # a long run's ended keys: keep the newest
                for k in list(self._ended)[:50_000]:
                    del self._ended[k]
        return session

    def lookup(self, key: str | None) -> tuple[str, Session | None]:
        """("server", None), ("session", s), ("ended", None) or ("unknown", None) for a bearer key."""
        if key is None:
            return ("server" if self.api_key is None else "unknown"), None
        with self._lock:
            s = self._by_key.get(key)
            if s is not None:
                return "session", s
            if key in self._ended:
                return "ended", None
        if self.api_key is None or secrets.compare_digest(key, self.api_key):
            return "server", None
        return "unknown", None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    # How long after its session opened an episode's first request is waited for: episodes start
    # together and ask within a few hundred milliseconds; one that has not asked by then (it failed or
    # hangs before its first request) must not hold the others' batches.
    first_request_s = 0.5

    def running(self) -> int:
        """The requests a batch may wait for: awaited sessions under way (asked, not ended), and those
        opened less than ``first_request_s`` ago that have not asked yet."""
        now = time.time()
        with self._lock:
            return self._running + sum(1 for s in self._fresh.values() if now - s.created < self.first_request_s)
