"""The OpenAI request bodies the server accepts, and the error shape it answers with.

Validated by pydantic before anything reaches the engine: a field of the wrong type, a value out of
range or a field the API does not have is a 400 naming it. Parameters of the API that this server
cannot honour (``n`` > 1, ``top_logprobs``, penalties other than 0) are a 400 saying so, never
silently ignored; a few that change nothing here (``user``, ``store``, ``metadata``,
``parallel_tool_calls``, ``stream_options``...) are accepted so that unmodified harnesses work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Sent by common clients and harnesses; they change nothing in what this server generates.
_ACCEPTED_NOOP = {"user", "store", "metadata", "parallel_tool_calls", "service_tier",
                  "reasoning_effort", "modalities", "prediction", "web_search_options", "safety_identifier",
                  "prompt_cache_key", "verbosity", "function_call", "functions", "logit_bias"}


class APIError(Exception):
    """An error the server answers in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON string, as the API sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The position of a streamed call: clients that rebuild the reply from the stream (the openai SDK's
    # ChatCompletionStream, verifiers' chat harness) send it back in the history; it changes nothing here.
    index: int | None = None
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; other parts are a 400)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content part of type {part.type!r} is not supported (text only)",
                               param="messages")
            out.append(part.text)
        return "".join(out)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: dict[str, str]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported: send the request n times (each is batched)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", param=name)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise APIError(400, "top_logprobs is not supported: logprobs=true gives each sampled token's",
                           param="top_logprobs")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than text is not supported", param="response_format")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if not self.tools or name not in {t.function.name for t in self.tools}:
                raise APIError(400, f"tool_choice names {name!r}, which is not among tools", param="tool_choice")
        elif self.tool_choice == "required" and not self.tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, "a batch of prompts is not supported: send one per request", param="prompt")
        if self.logprobs:
            raise APIError(400, "logprobs > 0 (top alternatives) is not supported; logprobs=0 gives the sampled "
                           "tokens'", param="logprobs")
        for name in ("echo", "suffix", "best_of"):
            if getattr(self, name) not in (None, False, 1):
                raise APIError(400, f"{name} is not supported", param=name)


def split_noop(body: dict[str, Any]) -> dict[str, Any]:
    """The body without the fields that change nothing here (see the module doc)."""
    return {k: v for k, v in body.items() if k not in _ACCEPTED_NOOP}


def validation_message(err: Any) -> tuple[str, str | None]:
    """A pydantic ValidationError as one line naming the field, and that field's name."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return f"unknown field {loc!r}: not a parameter of this API", loc.split(".")[0] or None
    return f"{loc}: {first.get('msg', 'invalid')}", loc.split(".")[0] or None
