"""A tool-using agent written only against an OpenAI client: it asks the model, runs the tool the
model calls, hands back the result, and scores the final answer. Nothing in it knows about training.

Two agents over the same task:

* ``solve``, for the tiny model, in the format its bootstrap taught it: a call is
  ``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``, a result comes back as a
  ``tool`` message ``<tool_response>3</tool_response>``, and the answer is ``\\boxed{3}``. It parses the
  call from the reply's text itself (the tools' schemas are too long for a 160-token model's context).
* ``solve_with_tools``, for any chat model: the API's own tool calling. It sends ``tools=`` (the server
  renders them with the model's chat template, or describes them in a system message in the Hermes
  convention when the template cannot), runs the ``message.tool_calls`` the server parsed, and
  answers them with ``tool`` messages carrying their ids.
"""

from __future__ import annotations

import json
import re

from nemo_like.environments.tool_calls import answers_match, canonical_call, extract_tool_answer
from nemo_like.environments.tools import get_tool, tool_schemas

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
# Partial credit for calling the right tool with the right arguments, answer right or not (below 1,
# so that success, reward >= 1, still means a right answer): the tool task's call_match_reward.
CALL_CREDIT = 0.5


def parse_call(text: str) -> dict | None:
    m = CALL.search(text)
    try:
        return json.loads(m.group(1)) if m else None
    except ValueError:
        return None


def run_tool(text: str) -> str:
    """The tool response for the call in ``text`` (an error message when there is none or it fails)."""
    call = parse_call(text)
    try:
        result = get_tool(call["name"]).fn(**call["arguments"])
        return f"<tool_response>{json.dumps(result)}</tool_response>"
    except Exception as e:
        return f'<tool_response>{{"error": "{type(e).__name__}"}}</tool_response>'


class _Score:
    """Both agents' reward: 1 for the right answer, else 0, plus ``CALL_CREDIT`` once the expected call
    (the row's ``expected_calls``) was made."""

    def __init__(self, row: dict):
        self.truth = str(row["ground_truth"])
        self.expected = {canonical_call(c) for c in json.loads(row.get("expected_calls") or "[]")}
        self.called: set = set()

    def result(self, answer: str | None, turns: int) -> dict:
        """``answer``: the final reply's text (None: no answer within the turns)."""
        correct = answer is not None and answers_match(extract_tool_answer(answer), self.truth)
        credit = CALL_CREDIT if self.expected and self.expected <= self.called else 0.0
        return {"reward": float(correct) + credit, "correct": float(correct), "turns": turns}


async def solve(client, row, max_turns: int = 3) -> dict:
    """One episode: up to ``max_turns`` model turns, scored by ``_Score``."""
    messages = list(row["messages"])
    score = _Score(row)
    for turn in range(max_turns):
        # No max_tokens: the server's limit (the run's policy.generation.max_new_tokens, and the context)
        # applies; a request whose prompt plus max_tokens passed the context would be refused (400).
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["</tool_call>"])
        choice = reply.choices[0]
        text = choice.message.content or ""
        if choice.finish_reason == "stop" and "<tool_call>" in text:  # stopped right after a call
            text += "</tool_call>"
            score.called.add(canonical_call(parse_call(text)))
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": run_tool(text)}]
            continue
        return score.result(text, turn + 1)
    return score.result(None, max_turns)


SYSTEM = "Use the tools to answer. Give the final answer as \\boxed{number}."


async def solve_with_tools(client, row, max_turns: int = 3) -> dict:
    """``solve`` through ``tools=`` and ``message.tool_calls``, with the same reward."""
    messages = [{"role": "system", "content": SYSTEM}, *row["messages"]]
    score = _Score(row)
    tools = tool_schemas(["add", "mul", "lookup"])
    for turn in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        if not message.tool_calls:
            return score.result(message.content or "", turn + 1)
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for c in message.tool_calls:
            try:
                args = json.loads(c.function.arguments)
                score.called.add(canonical_call({"name": c.function.name, "arguments": args}))
                content = json.dumps(get_tool(c.function.name).fn(**args))
            except Exception as e:
                content = json.dumps({"error": type(e).__name__})
            messages.append({"role": "tool", "tool_call_id": c.id, "content": content})
    return score.result(None, max_turns)
