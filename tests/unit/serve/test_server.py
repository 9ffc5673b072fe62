"""The OpenAI-compatible server over a real tiny model, driven by the official `openai` client and raw
HTTP: API shapes, token-exact sessions, errors, batching of concurrent requests."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import httpx
import openai
import pytest

from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
from nemo_like.serve.loading import load_engine
from nemo_like.serve.server import ServeError, start_server

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_tiny")
    tok = build_char_tokenizer(d)
    build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=1024, seed=0, save_dir=d)
    engine = load_engine(str(d), max_num_seqs=8)
    handle = start_server(engine, model_name=MODEL)
    yield handle
    handle.stop()
    engine.close()


def client(server, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key or server.api_key, max_retries=0)


def ask(c, content="2+2=", **kw):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_and_a_completion_with_usage_and_logprobs(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = ask(c, max_tokens=7, logprobs=True, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(choice.logprobs.content) <= 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The char tokenizer: the prompt is the ChatML text, one token per character or marker.
    text = "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert r.usage.prompt_tokens == len(text) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)


def test_greedy_is_deterministic_streamed_or_not_and_under_concurrency(server):
    c = client(server)
    want = ask(c, "abc", max_tokens=9, temperature=0).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       ask(c, "abc", max_tokens=9, temperature=0, stream=True) if ch.choices)
    assert streamed == want

    async def many():
        ac = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
        rs = await asyncio.gather(*[ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "abc" if i % 2 else f"q{i}"}], max_tokens=9,
            temperature=0 if i % 2 else 1.0) for i in range(24)])
        await ac.close()
        return rs
    rs = asyncio.run(many())
    # Batched with 23 others (sampled and greedy rows mixed), a greedy row's answer is unchanged.
    assert [r.choices[0].message.content for r in rs[1::2]] == [want] * 12


def test_stream_usage_chunk_and_stop_strings(server):
    c = client(server)
    chunks = list(ask(c, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # A stop string that ends the reply is left out of its content.
    full = ask(c, "xyz", max_tokens=12, temperature=0).choices[0].message.content
    stop = full[3:5]
    cut = ask(c, "xyz", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]


def test_session_joins_turns_token_for_token(server):
    tok = server.engine.tokenizer
    s = server.sessions.open(tag=0)
    c = client(server, s.key)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for turn in range(3):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stop=["q"])
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "tool", "content": f"result {turn}"}]
    assert [t.extends for t in s.turns] == [False, True, True] and s.prefix_breaks == 0
    for prev, t in zip(s.turns, s.turns[1:]):
        joined = prev.prompt_ids + prev.sampled_ids
        assert t.prompt_ids[: len(joined)] == joined  # the sampled ids themselves, not a re-tokenization
    [log] = s.samples(tok)
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["token_ids"].tolist() for m in log if m["role"] == "assistant"] == [t.sampled_ids for t in s.turns]
    assert [m["generation_logprobs"].tolist() for m in log if m["role"] == "assistant"] == \
        [pytest.approx(t.logprobs) for t in s.turns]
    flat = [i for m in log for i in m["token_ids"].tolist()]
    assert flat == s.turns[-1].prompt_ids + s.turns[-1].sampled_ids


def test_rewritten_history_starts_a_new_sample(server):
    s = server.sessions.open()
    c = client(server, s.key)
    msgs = [{"role": "user", "content": "first question"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    # The harness summarises: the earlier turns are replaced by a note.
    msgs = [{"role": "user", "content": "summary: asked once"}, {"role": "user", "content": "go on"}]
    c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert r.choices[0].message.content is not None
    assert [t.extends for t in s.turns] == [False, False] and s.prefix_breaks == 1
    logs = s.samples(server.engine.tokenizer)
    assert len(logs) == 2 and all(log[-1]["token_ids"].tolist() == t.sampled_ids for log, t in zip(logs, s.turns))


def test_server_key_requests_are_not_recorded_and_ended_sessions_refused(server):
    before = len(server.sessions)
    ask(client(server), max_tokens=2)
    assert len(server.sessions) == before
    s = server.sessions.open()
    server.sessions.end(s)
    with pytest.raises(openai.APIStatusError) as e:
        ask(client(server, s.key), max_tokens=2)
    assert e.value.status_code == 410 and "ended" in e.value.body["message"]


def _post(server, path, body, key="server", raw=None):
    headers = {"Authorization": f"Bearer {server.api_key if key == 'server' else key}"} if key else {}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers | {"content-type": "application/json"},
                      timeout=30)


@pytest.mark.parametrize("body,raw,key,status,needle", [
    (None, b"{not json", "server", 400, "not JSON"),
    (None, b"[1, 2]", "server", 400, "JSON object"),
    ({"model": MODEL, "messages": []}, None, "server", 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "bogus": 1}, None, "server", 400, "bogus"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, None, "server", 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, "server", 400, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}, None, "server", 400, "n > 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
      "function": {"name": "bad name!"}}]}, None, "server", 400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None, "server",
     400, "required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, None, None, 401, "API key"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, None, "sk-wrong", 401, "API key"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, None, "server", 404, "gpt-4o"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}, None, "server", 400, "context"),
    (None, b"{" + b" " * (9 * 2**20) + b"}", "server", 413, "limit"),
    (None, b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "a\\ud800"}]}', "server", 400,
     "not valid Unicode"),
])
def test_bad_requests_get_openai_errors(server, body, raw, key, status, needle):
    r = _post(server, "/v1/chat/completions", body, key=key, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_unknown_route_and_raw_completions(server):
    r = httpx.get(server.url + "/v1/engines", headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 404 and "error" in r.json()
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    ids = server.engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    b = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="token ids"):
        c.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)


def test_a_port_in_use_is_one_clear_error(server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ServeError, match=f"port {port} .* already in use"):
            start_server(server.engine, model_name=MODEL, port=port)


def test_a_reply_sampled_in_pieces_is_never_retokenized(tmp_path):
    """The model spelled "<tool_call>" character by character, where tokenizing the text gives one
    token: the next prompt keeps the spelled-out ids (what was sampled and will be trained)."""
    from nemo_like.data.chat_templates import CHATML_TEMPLATE
    from nemo_like.serve.sessions import Session, Turn

    tok = build_char_tokenizer(tmp_path, extra_tokens=["<tool_call>"])
    tok.chat_template = CHATML_TEMPLATE
    first = [{"role": "user", "content": "go"}]
    text = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    s = Session(id="s", key="k")
    prompt, extends = s.prompt_ids(text, tok)
    sampled = [tok.convert_tokens_to_ids(c) for c in "<tool_call>x"] + [tok.eos_token_id]
    assert tok("<tool_call>x", add_special_tokens=False)["input_ids"] != sampled[:-1]  # one token, re-tokenized
    s.record(Turn(prompt, sampled, [-1.0] * len(sampled), 0, "stop", "<tool_call>x", extends))
    second = first + [{"role": "assistant", "content": "<tool_call>x"}, {"role": "tool", "content": "1"}]
    text2 = tok.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    ids, extends = s.prompt_ids(text2, tok)
    assert extends and ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tok.decode(ids, skip_special_tokens=False) == text2


def test_the_serve_command_prints_its_url_serves_and_stops_on_ctrl_c(tmp_path, capsys):
    import re
    import signal
    import subprocess
    import sys

    tok = build_char_tokenizer(tmp_path)
    build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256, seed=0,
                     save_dir=tmp_path)
    cmd = [sys.executable, "-m", "nemo_like.serve", "--model", str(tmp_path), "--port", "0", "--api-key", "sk-test",
           "--served-model-name", "mine", "--decode-mode", "static"]
    # A shell without job control starts background jobs with Ctrl-C ignored, and a child inherits
    # that (CI run in the background: the server ignored it, as a `nohup ... &` server should). A handler
    # is not inherited: the child gets Python's own.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+/v1) \(context 256 tokens\)", line).group(1)
        assert proc.stdout.readline().strip() == "[nemo_like] api key: sk-test"
        c = openai.OpenAI(base_url=url, api_key="sk-test", max_retries=0)
        r = c.chat.completions.create(model="mine", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens <= 3
        # The port is taken now: a second server says so in one line and exits 2.
        port = url.rsplit(":", 1)[1].split("/")[0]
        from nemo_like.serve.__main__ import main

        assert main(["--model", str(tmp_path), "--port", port]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: --port={port}: port {port} on 127.0.0.1 is already in use; pick another port or 0 for a free one")
    finally:
        _interrupt_another_thread(proc.pid)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # no server left behind
            raise
    assert proc.returncode == 0 and "stopping" in out


def _interrupt_another_thread(pid: int) -> None:
    """Ctrl-C as the kernel may deliver it: to any thread of the process, here one that is not the main
    thread (the server once slept on for an hour when the engine's thread took it). Linux: tgkill."""
    import ctypes
    import signal

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid) if os.path.isdir("/proc") else []
    libc = ctypes.CDLL(None, use_errno=True)
    if not tids or not hasattr(libc, "tgkill"):
        os.kill(pid, signal.SIGINT)
        return
    assert libc.tgkill(pid, tids[0], signal.SIGINT) == 0, ctypes.get_errno()


def test_hostile_requests_never_get_a_500_and_the_server_keeps_answering(server):
    import importlib.util
    import random
    from collections import Counter
    from pathlib import Path

    # The benchmark's fuzz (1,000 requests there), a smaller draw here.
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_agent_endpoint.py"
    spec = importlib.util.spec_from_file_location("bench_agent_endpoint", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    ended = server.sessions.open()
    server.sessions.end(ended)
    statuses = Counter()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path, headers, body in bench.hostile_requests(100, server.api_key, ended.key, random.Random(1)):
            r = c.request(method, path, headers=headers, content=body)
            statuses[r.status_code] += 1
            assert r.status_code < 500, (path, body[:200], r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert {400, 401, 404, 410, 413} <= set(statuses)
    assert ask(client(server), max_tokens=2).choices[0].finish_reason in ("stop", "length")
