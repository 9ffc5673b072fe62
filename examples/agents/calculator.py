"""A tool-using agent written only against an OpenAI client: it asks the model, runs the tool the
model calls, hands back the result, and scores the final answer. Nothing in it knows about training.

The tiny model's tool format (what its bootstrap taught it): a call is
``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``, a result comes back as a
``tool`` message ``<tool_response>3</tool_response>``, and the answer is ``\\boxed{3}``. The agent
parses the call from the reply's text itself (its tools are too long to describe to a 160-token model
in a system message); a model whose chat template renders tools would get ``tools=`` and read
``message.tool_calls`` instead.
"""

from __future__ import annotations

import json
import re

from nemo_like.environments.tool_calls import answers_match, extract_tool_answer
from nemo_like.environments.tools import get_tool

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def run_tool(text: str) -> str:
    """The tool response for the call in ``text`` (an error message when there is none or it fails)."""
    m = CALL.search(text)
    try:
        call = json.loads(m.group(1)) if m else None
        result = get_tool(call["name"]).fn(**call["arguments"])
        return f"<tool_response>{json.dumps(result)}</tool_response>"
    except Exception as e:
        return f'<tool_response>{{"error": "{type(e).__name__}"}}</tool_response>'


async def solve(client, row, max_turns: int = 3) -> dict:
    """One episode: up to ``max_turns`` model turns; reward 1 for the right answer, else 0."""
    messages = list(row["messages"])
    for turn in range(max_turns):
        # No max_tokens: the server's limit (the run's policy.generation.max_new_tokens, and the context)
        # applies; a request whose prompt plus max_tokens passed the context would be refused (400).
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["</tool_call>"])
        choice = reply.choices[0]
        text = choice.message.content or ""
        if choice.finish_reason == "stop" and "<tool_call>" in text:  # stopped right after a call
            text += "</tool_call>"
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": run_tool(text)}]
            continue
        correct = answers_match(extract_tool_answer(text), str(row["ground_truth"]))
        return {"reward": float(correct), "turns": turn + 1}
    return {"reward": 0.0, "turns": max_turns}
