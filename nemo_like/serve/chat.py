"""Chat requests as the model sees them, and the model's text as the API returns it.

Rendering: the tokenizer's chat template renders the messages. ``tools`` go to the template when it
has tool support of its own (its text mentions ``tools``, as Qwen's, Llama 3.1's and Hermes'
templates do); for a template without it they are described in the system message in the Hermes
convention the tool environment uses (``<tools>`` JSON schemas, calls as ``<tool_call>{json}
</tool_call>``), so the same parser reads the answer. An assistant message's ``tool_calls`` are
rendered back in that convention too, for templates that would drop them.

Parsing: ``<tool_call>`` blocks become ``tool_calls`` (ids, name, arguments as a JSON string) and
``finish_reason: "tool_calls"``; text that tries to call and is malformed is returned as content
(and counted by the server), never an error.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from nemo_like.data.processors import render_chat
from nemo_like.environments.tool_calls import TOOL_CALL_OPEN, format_tool_call, parse_tool_calls
from nemo_like.serve.protocol import APIError, ChatCompletionRequest, NamedToolChoice


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def hermes_tools_text(schemas: list[dict[str, Any]], choice: Any = None) -> str:
    """The tools described for a system message (one JSON schema per line, then how to call)."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    text = (f"# Tools\n\nThese functions can be called; their JSON schemas:\n<tools>\n{listing}\n</tools>\n\n"
            f"To call one, write {TOOL_CALL_OPEN}{{\"name\": <name>, \"arguments\": <JSON object>}}</tool_call>.")
    if choice == "required":
        text += " Call at least one function."
    elif isinstance(choice, NamedToolChoice):
        text += f" Call the function {choice.function.get('name')}."
    return text


def _message_dict(m: Any) -> dict[str, Any]:
    """One request message as the template takes it (role, content text; tool_calls rendered as text)."""
    role = "system" if m.role == "developer" else m.role
    text = m.text()
    if m.role == "assistant" and m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError as e:
                raise APIError(400, f"tool call {c.id!r}: arguments are not JSON ({e.msg})", param="messages") from e
            calls.append(format_tool_call(c.function.name, args if isinstance(args, dict) else {}))
        text = text + "".join(calls)
    return {"role": role, "content": text}


def chat_messages(req: ChatCompletionRequest, tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The request's messages as template input, and the tools to hand the template (None: described
    in the system message instead, or none)."""
    messages = [_message_dict(m) for m in req.messages]
    if not req.tools or req.tool_choice == "none":
        return messages, None
    schemas = [t.model_dump(exclude_none=True) for t in req.tools]
    if template_renders_tools(tokenizer) and req.tool_choice in (None, "auto"):
        return messages, schemas
    text = hermes_tools_text(schemas, req.tool_choice)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages, None


def render_prompt(req: ChatCompletionRequest, tokenizer: Any) -> str:
    """The prompt text of a chat request, ending with the assistant's generation prompt."""
    messages, tools = chat_messages(req, tokenizer)
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools)
    except APIError:
        raise
    except Exception as e:  # a template that refuses these messages (roles, order): the request's fault
        raise APIError(400, f"the model's chat template cannot render these messages: {e}", param="messages") from e
    return check_text(text, "messages")


def check_text(text: str, param: str) -> str:
    """``text``, or a 400 when it is not valid Unicode (JSON can carry lone surrogates; no tokenizer
    takes them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: text is not valid Unicode ({e.reason} at position {e.start})",
                       param=param) from None
    return text


def parse_reply(text: str, tools_offered: bool) -> tuple[str | None, list[dict[str, Any]] | None, bool]:
    """(content, tool_calls, malformed): a reply's ``<tool_call>`` blocks as API tool calls, the rest
    as content. Without tools offered the text is all content."""
    if not tools_offered or TOOL_CALL_OPEN not in text:
        return text, None, False
    calls, error = parse_tool_calls(text)
    if error is not None or not calls:
        return text, None, error is not None
    content = text[: text.index(TOOL_CALL_OPEN)].strip() or None
    out = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
           for c in calls]
    return content, out, False
