"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, and ``/v1/nemo_like/reward`` for a session's program to post its reward.

Every error is OpenAI's body (``{"error": {...}}``) with a status naming the problem: 400 malformed or
unsupported, 401 a missing or wrong key, 404 an unknown model or route, 410 an ended session, 413 a
body over the limit. The counters in ``app.state.stats`` say what was served and refused.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nemo_like.models.generation.request_stream import FINISH_ROUTE, TAKE_ROUTE
from nemo_like.serve.chat import check_text, parse_reply, render_prompt
from nemo_like.serve.engines import GenParams
from nemo_like.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, split_noop, validation_message
from nemo_like.serve.sessions import Session, SessionStore, Turn

MAX_BODY_BYTES = 8 * 2**20


def build_app(engine: Any, *, model_name: str, sessions: SessionStore, fixed_sampling: bool = False) -> FastAPI:
    """The API over ``engine`` (``serve.engines``). ``fixed_sampling``: the engine's temperature and
    top-p are used whatever a request asks (training: the trainer recomputes log-probs at those)."""
    app = FastAPI(title="nemo_like OpenAI-compatible server", docs_url=None, redoc_url=None)
    app.state.stats = stats = Counter()
    app.state.sessions = sessions
    tok = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        stats[f"status_{exc.status}"] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        stats[f"status_{exc.status_code}"] += 1
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     type=kind).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        stats["status_500"] += 1
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body(),
                            status_code=500)

    def _auth(request: Request) -> Session | None:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        kind, session = sessions.lookup(key or None)
        if kind == "unknown":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", type="authentication_error",
                           code="invalid_api_key")
        if kind == "ended":
            raise APIError(410, "this session has ended (its episode is over); a new episode gets a new key",
                           code="session_ended")
        return session

    async def _body(request: Request, model_cls: type) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
        try:
            req = model_cls.model_validate(split_noop(data))
        except ValidationError as e:
            msg, param = validation_message(e)
            raise APIError(400, msg, param=param) from None
        if req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        req.check_supported()
        return req

    def _params(req: Any, n_prompt: int, limit: int | None) -> GenParams:
        ctx = engine.context_length
        if n_prompt >= ctx:
            raise APIError(400, f"the prompt is {n_prompt} tokens; this model's context is {ctx} tokens",
                           param="messages", code="context_length_exceeded")
        if limit is not None and n_prompt + limit > ctx:
            raise APIError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({limit}) is over this model's "
                           f"context of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        return GenParams(max_new_tokens=limit or ctx - n_prompt,
                         temperature=None if fixed_sampling else (1.0 if req.temperature is None else req.temperature),
                         top_p=None if fixed_sampling else req.top_p, stop=req.stop_list())

    def _text(ids: list[int], stop: list[str], finish: str) -> str:
        text = tok.decode(ids, skip_special_tokens=True)
        if finish == "stop":  # the API leaves out the stop string that ended the text
            for s in stop:
                if text.endswith(s):
                    return text[: -len(s)]
        return text

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nemo_like"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/nemo_like/reward")
    async def reward(request: Request) -> dict[str, Any]:
        session = _auth(request)
        if session is None:
            raise APIError(400, "a reward is posted with a session's key, not the server's")
        raw = await request.body()
        try:
            value = float(json.loads(raw)["reward"])
        except Exception:
            raise APIError(400, 'body must be {"reward": <number>}', param="reward") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise APIError(400, "reward must be a finite number", param="reward")
        session.reward = value
        return {"ok": True}

    if hasattr(engine, "take"):  # a StreamingEngine: a worker's continuous engine takes the turns
        def _engine_auth(request: Request) -> None:
            if _auth(request) is not None:
                raise APIError(403, "the engine routes take the server's key, not a session's",
                               type="permission_error")

        async def _json(request: Request) -> dict[str, Any]:
            try:
                body = json.loads(await request.body() or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"request body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise APIError(400, "request body must be a JSON object")
            return body

        @app.post(TAKE_ROUTE)
        async def engine_take(request: Request) -> dict[str, Any]:
            _engine_auth(request)
            wait = (await _json(request)).get("wait_s", 0.02)
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 5:
                raise APIError(400, "wait_s must be a number of seconds in [0, 5]", param="wait_s")
            return await engine.take(float(wait))

        @app.post(FINISH_ROUTE)
        async def engine_finish(request: Request) -> dict[str, Any]:
            _engine_auth(request)
            results = (await _json(request)).get("results")
            if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
                raise APIError(400, "results must be a list of objects", param="results")
            try:
                return {"matched": engine.finish(results)}
            except (KeyError, TypeError, ValueError) as e:
                raise APIError(400, f"a result is malformed: {type(e).__name__}: {e}", param="results") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        # Counted as busy while parsed or answered, not while generating (BatchingEngine's gather).
        async with engine.serving() as serving:
            return await _chat(request, serving)

    async def _chat(request: Request, serving: Any) -> Response:
        session = _auth(request)
        if session is not None:
            sessions.mark_asked(session)
        req: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        async with _session_lock(session):
            if session is not None:  # the session's own replies stand as the tokens it sampled
                for m in req.messages:
                    if m.role == "assistant":
                        raw = session.replay_text(m.text(), [c.id for c in m.tool_calls or []])
                        if raw is not None:
                            m.content, m.tool_calls = raw, None
            text = render_prompt(req, tok)
            if session is not None:
                prompt_ids, extends = session.prompt_ids(text, tok)
            else:
                prompt_ids, extends = list(tok(text, add_special_tokens=False)["input_ids"]), False
            params = _params(req, len(prompt_ids), req.token_limit())
            if session is not None and session.greedy:
                params.temperature = 0.0
            gen = await serving.generate(prompt_ids, params)
            out_text = _text(gen.token_ids, params.stop, gen.finish_reason)
            offered = bool(req.tools) and req.tool_choice != "none"
            content, calls, malformed = parse_reply(out_text, offered)
            stats["malformed_tool_calls"] += int(malformed)
            finish = "tool_calls" if calls else gen.finish_reason
            if session is not None:
                session.malformed_tool_calls += int(malformed)
                session.record(Turn(prompt_ids, gen.token_ids, gen.logprobs, gen.version, finish,
                                    _raw_text(tok, gen.token_ids), extends,
                                    [c["id"] for c in calls or []], content))
        stats["chat_completions"] += 1
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                 "total_tokens": len(prompt_ids) + len(gen.token_ids)}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = ({"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()),
                                  "top_logprobs": []} for t, lp in zip(gen.token_ids, gen.logprobs)]}
                    if req.logprobs else None)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(_chat_stream(cid, created, message, finish, usage if req.include_usage() else None),
                                     media_type="text/event-stream")
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                          "finish_reason": finish}], "usage": usage})

    async def _chat_stream(cid: str, created: int, message: dict, finish: str,
                           usage: dict | None) -> AsyncIterator[str]:
        # The turn is generated whole, then sent as chunks in the streaming shape (role, content,
        # tool calls, finish), so harnesses that only stream work unchanged.
        def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> str:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            return f"data: {json.dumps(body | extra)}\n\n"
        yield chunk({"role": "assistant", "content": ""})
        if message.get("content"):
            yield chunk({"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": i} | call]})
        yield chunk({}, finish)
        if usage is not None:  # stream_options.include_usage: a last chunk with no choices
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async with engine.serving() as serving:
            return await _completions(request, serving)

    async def _completions(request: Request, serving: Any) -> Response:
        _auth(request)  # raw prompts are not recorded as episode turns
        req: CompletionRequest = await _body(request, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(tok(check_text(prompt, "prompt"), add_special_tokens=False)["input_ids"])
        else:
            vocab = len(tok)
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        params = _params(req, len(ids), req.max_tokens or 16)
        gen = await serving.generate(ids, params)
        text = _text(gen.token_ids, params.stop, gen.finish_reason)
        stats["completions"] += 1
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                 "total_tokens": len(ids) + len(gen.token_ids)}
        lp = ({"tokens": [tok.decode([t]) for t in gen.token_ids], "token_logprobs": gen.logprobs,
               "top_logprobs": None, "text_offset": []} if req.logprobs is not None else None)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": gen.finish_reason}
        if req.stream:
            async def events() -> AsyncIterator[str]:
                body = {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [choice]}
                yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [choice], "usage": usage})

    return app


def _raw_text(tok: Any, ids: list[int]) -> str:
    """The sampled text as the template must render it back for the ids to match: special tokens kept
    (a model may sample any), less the end-of-sequence token the template adds itself."""
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class _NoLock:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: Any) -> None:
        return None


def _session_lock(session: Session | None) -> Any:
    """A session's requests one at a time (its turns join in order); the server's own requests unlocked."""
    if session is None:
        return _NoLock()
    lock = getattr(session, "_alock", None)
    if lock is None:
        lock = session._alock = asyncio.Lock()
    return lock
