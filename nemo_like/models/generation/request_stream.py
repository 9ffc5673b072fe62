"""Requests from an OpenAI-compatible server, decoded by this process's continuous engine as they
arrive (a ``RequestSource`` of ``engine.ContinuousBatcher``).

The trainer's server (``serve.engines.StreamingEngine``) runs in the driver; the model is here, in a
training or rollout worker. :class:`RemoteRequests` pulls the server's queued turns over HTTP
(``POST /v1/nemo_like/engine/take``, a long poll) on a thread of its own, hands them to the engine
between two decode steps, and sends each turn's tokens back (``.../engine/finish``) as soon as its
row ends. An agent's second turn thus joins the rows still decoding others' first turns, as a
streamed episode's does, instead of waiting for a whole batch to end; with the prefix cache it
prefills only what the first turn did not. The server says when the rollout is over
(``closed``); the source is exhausted once every turn it took has been answered.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import httpx
import torch

from nemo_like.models.generation.engine import ContinuousBatcher, decoding_mode, unsupported_reason

__all__ = ["RemoteRequests", "TAKE_ROUTE", "FINISH_ROUTE"]

TAKE_ROUTE = "/v1/nemo_like/engine/take"
FINISH_ROUTE = "/v1/nemo_like/engine/finish"
# The long poll's wait when the engine has nothing queued (seconds): short, since a turn that arrives
# while a take is out waits for it to return.
TAKE_WAIT_S = 0.02


class RemoteRequests:
    """The server at ``url`` (its root, ``http://host:port``) as a request source; ``key``: the server's
    API key. ``stats`` after the run: turns taken and answered, and take calls made."""

    def __init__(self, url: str, key: str | None, *, timeout_s: float = 60.0):
        self._http = httpx.Client(base_url=url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {key}"} if key else {})
        self._incoming: deque[dict] = deque()
        self._outgoing: list[dict] = []
        self._cond = threading.Condition()
        self.request_of: dict[int, str] = {}  # engine request -> the server's id for the turn
        self.closed = False  # the server said the rollout is over
        self.error: BaseException | None = None
        self.stats = {"taken": 0, "answered": 0, "takes": 0}
        self._stop = False
        self._thread = threading.Thread(target=self._pump, name="nemo-like-requests", daemon=True)
        self._thread.start()

    # ---- the pump thread: one take or finish call at a time -------------------------------------
    def _pump(self) -> None:
        try:
            while True:
                with self._cond:
                    out, self._outgoing = self._outgoing, []
                    idle = not self.request_of and not self._incoming
                    if self._stop or (self.closed and idle and not out):
                        return
                if out:
                    self._post(FINISH_ROUTE, {"results": out})
                    self.stats["answered"] += len(out)
                    continue
                if self.closed:  # answers still to come from the engine
                    with self._cond:
                        self._cond.wait(timeout=0.05)
                    continue
                body = self._post(TAKE_ROUTE, {"wait_s": TAKE_WAIT_S})
                self.stats["takes"] += 1
                with self._cond:
                    self._incoming.extend(body.get("requests") or [])
                    self.stats["taken"] += len(body.get("requests") or [])
                    self.closed = bool(body.get("closed"))
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - the engine's thread raises it (poll)
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _post(self, route: str, body: dict) -> dict:
        r = self._http.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {route} with {r.status_code}: {r.text[:300]}")
        return r.json()

    # ---- RequestSource ------------------------------------------------------------------------
    def poll(self, batcher: ContinuousBatcher, block: bool) -> None:
        with self._cond:
            if block and not self._incoming and self.error is None and not self.closed:
                self._cond.wait(timeout=0.05)
            if self.error is not None:
                raise RuntimeError(f"lost the server's requests: {type(self.error).__name__}: {self.error}")
            taken, self._incoming = list(self._incoming), deque()
        for r in taken:
            try:
                ids = torch.tensor([r["ids"]], dtype=torch.long)
                [req] = batcher.add(ids, torch.tensor([len(r["ids"])]), [r.get("stop") or None],
                                    greedy=bool(r.get("greedy")), temperature=r.get("temperature"),
                                    top_p=r.get("top_p"), max_new_tokens=r.get("max_new_tokens"))
                self.request_of[req] = r["id"]
            except Exception as e:  # one bad turn fails alone
                self._answer({"id": r["id"], "error": f"{type(e).__name__}: {e}"})

    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None:
        for req in requests:
            rid = self.request_of.pop(req, None)
            if rid is None:
                continue
            tokens, lps, ended = batcher.result(req)
            self._answer({"id": rid, "token_ids": tokens.tolist(), "logprobs": lps.tolist(),
                          "finish_reason": "stop" if ended else "length"})

    def exhausted(self) -> bool:
        with self._cond:
            if self.error is not None:
                return True
            return self.closed and not self._incoming

    def _answer(self, result: dict) -> None:
        with self._cond:
            self._outgoing.append(result)
            self._cond.notify_all()

    def close(self, wait: bool = True) -> None:
        """``wait``: for the answers to go out (the pump ends once the server closed the rollout and
        nothing is left); then release the connection."""
        if wait:
            self._thread.join(timeout=60)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._http.close()


def serve_remote_requests(model: Any, tokenizer: Any, cfg: Any, url: str, key: str | None, *, max_total_length: int,
                          slots: int, device: torch.device, prefix_cache: Any = None) -> dict[str, float]:
    """Decode the server's turns with ``model`` until it closes the rollout; the source's stats."""
    if (why := unsupported_reason(model)) is not None:
        raise RuntimeError(f"the continuous engine cannot serve this model ({why}); set "
                           "policy.generation.engine=generate to batch the server's turns for generate()")
    source = RemoteRequests(url, key)
    t0 = time.perf_counter()
    ok = False
    try:
        with decoding_mode(model):
            ContinuousBatcher(model, tokenizer, None, cfg, greedy=False, max_total_length=max_total_length,
                              slots=slots, device=device, prefix_cache=prefix_cache).run(source)
        ok = True
    finally:
        source.close(wait=ok)
    if source.error is not None:
        raise RuntimeError(f"lost the server's requests: {type(source.error).__name__}: {source.error}")
    return {k: float(v) for k, v in source.stats.items()} | {"seconds": time.perf_counter() - t0}
