"""A third-party agent framework (the OpenAI Agents SDK, its chat-completions model) drives a tool-using
agent through the server: the model's tool call comes back as ``tool_calls``, the SDK runs the tool and
sends the result, and the session joins the two turns token for token.

The tiny model is first taught one conversation (call ``add``, then answer from its result) rendered by
a chat template with tool support of its own, so its prompts stay short."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
from nemo_like.serve.engines import LocalEngine
from nemo_like.serve.server import start_server

agents = pytest.importorskip("agents")  # the dev group's openai-agents

# ChatML that lists the tools' names in a system line (a template "with tool support", as Qwen's).
TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\nTools:' -}}{%- for t in tools -%}{{- ' ' + t['function']['name'] -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    d = tmp_path_factory.mktemp("harness_tiny")
    tok = build_char_tokenizer(d, extra_tokens=["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256, seed=0)
    tools = [{"type": "function", "function": {"name": "add"}}]
    user = [{"role": "user", "content": "1+2?"}]
    turns = [(user, CALL), (user + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "3"}],
                            "\\boxed{3}")]
    rows = []
    for msgs, reply in turns:  # prompt ids and the reply's (with its end of turn) to learn
        p = tok(tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        r = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p, r))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(150):
        for p, r in rows:
            ids = torch.tensor([p + r])
            labels = torch.tensor([[-100] * len(p) + r])
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    model.eval().requires_grad_(False)
    engine = LocalEngine(model, tok, GenerationConfig(max_new_tokens=64), context_length=256, slots=4)
    server = start_server(engine, model_name="policy")
    yield server
    server.stop()
    engine.close()


def test_the_openai_agents_sdk_runs_a_tool_loop_through_a_session(taught):
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    session = taught.sessions.open()
    client = AsyncOpenAI(base_url=taught.base_url, api_key=session.key, max_retries=0)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="adder", instructions=None, tools=[add],
                         model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "1+2?", max_turns=4))
    assert calls == [(1, 2)] and "\\boxed{3}" in result.final_output
    # Two requests; the second's prompt is the first's prompt and sampled ids, exactly, then the tool's.
    first, second = session.turns
    assert second.extends and session.prefix_breaks == 0
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.sampled_ids)] == first.prompt_ids + first.sampled_ids
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    [log] = session.samples(taught.engine.tokenizer)
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    assert [m["token_ids"].tolist() for m in log[1::2]] == [first.sampled_ids, second.sampled_ids]
