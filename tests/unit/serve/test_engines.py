"""The training server's engines. BatchingEngine: requests that arrive while the server is still
parsing others, or writing the last batch's answers, generate as one batch. StreamingEngine: a
worker's continuous engine takes the turns over HTTP as they come and answers each as it ends."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.request_stream import TAKE_ROUTE, serve_remote_requests
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
from nemo_like.serve.engines import BatchingEngine, GenParams, StreamingEngine
from nemo_like.serve.loading import load_engine
from nemo_like.serve.server import start_server


def echo_engine(tmp_path, sizes: list[int]) -> BatchingEngine:
    """An engine whose generator answers each prompt with its own last token twice (the batching is
    what is tested), recording the size of every generate call."""
    def generate(data: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        sizes.append(len(data["input_ids"]))
        lens = data["input_lengths"]
        out = torch.cat([data["input_ids"], torch.zeros(len(lens), 2, dtype=torch.long)], 1)
        for i, n in enumerate(lens.tolist()):
            out[i, n:n + 2] = out[i, n - 1]
        return BatchedDataDict(output_ids=out, logprobs=torch.full(out.shape, -0.5), unpadded_sequence_lengths=lens + 2,
                               truncated=torch.zeros(len(lens), dtype=torch.bool))
    return BatchingEngine(generate, build_char_tokenizer(tmp_path), context_length=64, gather_s=0.02)


async def _requests(engine: BatchingEngine, late_s: float, serving: bool) -> list:
    """Four requests: two at once, two ``late_s`` later (the server still parsing them: ``serving``)."""
    async def one(i: int, delay: float):
        if serving:
            async with engine.serving() as s:
                await asyncio.sleep(delay)  # parsing, rendering, tokenizing
                return await s.generate([5, 6, 7 + i], GenParams(max_new_tokens=8))
        await asyncio.sleep(delay)
        return await engine.generate([5, 6, 7 + i], GenParams(max_new_tokens=8))
    return await asyncio.gather(*[one(i, 0.0 if i < 2 else late_s) for i in range(4)])


def test_requests_the_server_is_still_handling_join_the_batch(tmp_path):
    sizes: list[int] = []
    engine = echo_engine(tmp_path, sizes)
    try:
        out = asyncio.run(_requests(engine, late_s=0.2, serving=True))
        assert sizes == [4]  # 0.2 s is ten times gather_s: only the busy count kept the batch open
        assert [o.token_ids for o in out] == [[7 + i] * 2 for i in range(4)]
        assert all(o.logprobs == [-0.5, -0.5] and o.finish_reason == "stop" for o in out)
        assert engine.busy == 0
        sizes.clear()
        asyncio.run(_requests(engine, late_s=0.2, serving=False))  # nothing said they were coming
        assert sizes == [2, 2]
    finally:
        engine.close()


def test_a_request_that_never_reaches_the_engine_holds_the_batch_only_up_to_max_gather(tmp_path):
    sizes: list[int] = []
    engine = echo_engine(tmp_path, sizes)
    engine.max_gather_s = 0.3

    async def run():
        async def stuck():  # a handler that takes far longer than max_gather_s to queue its turn
            async with engine.serving():
                await asyncio.sleep(1.5)
        task = asyncio.create_task(stuck())
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await engine.generate([1, 2, 3], GenParams(max_new_tokens=4))
        waited = loop.time() - t0
        await task
        return waited
    try:
        waited = asyncio.run(run())
        assert sizes == [1] and 0.25 < waited < 1.2
    finally:
        engine.close()


def test_a_batch_waits_for_every_running_episode_and_no_longer(tmp_path):
    # Four episodes running (the trainer's open sessions): the last asks 0.15 s after the first two,
    # far past gather_s, yet all four generate together, and the batch starts once the fourth is in
    # (not after a quiet gap). With one episode that never asks, the others go after expect_gap_s.
    from nemo_like.serve.sessions import SessionStore

    sizes: list[int] = []
    engine = echo_engine(tmp_path, sizes)
    store = SessionStore("server-key")
    sessions = [store.open(tag=i, awaited=True) for i in range(4)]
    for s in sessions:  # each asked before (its first turn): it is under way
        store.mark_asked(s)
    store.mark_asked(store.open(tag=9))  # a session whose end nobody reports (a client's own): never waited for
    store.open(tag=8, awaited=True).created -= 1  # opened 1 s ago and never asked (failed first): not waited for
    assert store.running() == 4
    fresh = store.open(tag=7, awaited=True)  # just opened: its first request is expected
    assert store.running() == 5
    store.end(fresh)
    engine.expected_fn = store.running
    engine.expect_gap_s = 0.3

    async def ask(delays):
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(i, delay):
            await asyncio.sleep(delay)
            await engine.generate([5, 6, 7 + i], GenParams(max_new_tokens=8))
            return loop.time() - t0
        return await asyncio.gather(*[one(i, d) for i, d in enumerate(delays)])
    try:
        done = asyncio.run(ask([0.0, 0.0, 0.1, 0.15]))
        assert sizes == [4]
        assert max(done) < 0.15 + 0.25  # began as the fourth came, not after another 0.3 s of quiet
        sizes.clear()
        store.end(sessions[3])  # that episode ended: three are expected now
        asyncio.run(ask([0.0, 0.05, 0.1]))
        assert sizes == [3]
        sizes.clear()
        store.mark_asked(store.open(tag=4, awaited=True))  # under way, but not asking (busy with a slow tool)
        done = asyncio.run(ask([0.0, 0.0, 0.0]))
        assert sizes == [3] and 0.25 < max(done) < 0.9  # expect_gap_s, then the others' batch
    finally:
        engine.close()


# ---- StreamingEngine: a worker's continuous engine takes the server's turns over HTTP ----------------

@pytest.fixture(scope="module")
def local(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_tiny")
    tok = build_char_tokenizer(d)
    build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256, seed=0, save_dir=d)
    engine = load_engine(str(d), max_num_seqs=4, max_model_len=128)
    yield engine
    engine.close()


async def _chats(server, prompts: list[str], **kw) -> list:
    c = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=60)
    try:
        return await asyncio.gather(*[c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": p}], **kw) for p in prompts])
    finally:
        await c.close()


def test_a_worker_engine_serves_the_turns_as_they_come_and_stops_when_the_rollout_closes(local):
    prompts = [f"{i}+{i}=" for i in range(7)]  # more than the 4 rows: some wait for a free row
    want_server = start_server(local, model_name="policy")
    engine = StreamingEngine(local.tokenizer, context_length=128, version_fn=lambda: 7)
    server = start_server(engine, model_name="policy")
    stats: dict = {}
    try:
        want = asyncio.run(_chats(want_server, prompts, max_tokens=9, temperature=0, logprobs=True))
        engine.open_rollout()
        worker = threading.Thread(target=lambda: stats.update(serve_remote_requests(
            local.model, local.tokenizer, local.cfg, server.url, server.api_key, max_total_length=128, slots=4,
            device=torch.device("cpu"))))
        worker.start()
        got = asyncio.run(_chats(server, prompts, max_tokens=9, temperature=0, logprobs=True))
        assert worker.is_alive()  # serving until the rollout closes
        engine.close_rollout()
        worker.join(timeout=30)
        assert not worker.is_alive()
    finally:
        server.stop()
        want_server.stop()
        engine.close()
    for g, w in zip(got, want):
        assert g.choices[0].message.content == w.choices[0].message.content
        assert g.choices[0].finish_reason == w.choices[0].finish_reason
        lp_g = [t.logprob for t in g.choices[0].logprobs.content]
        lp_w = [t.logprob for t in w.choices[0].logprobs.content]
        assert lp_g == pytest.approx(lp_w, abs=1e-4)
    assert stats["taken"] == stats["answered"] == len(prompts)


def test_turns_fail_at_once_when_the_worker_stops_serving_and_the_routes_want_the_servers_key(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    engine = StreamingEngine(tok, context_length=64)
    server = start_server(engine, model_name="policy")
    try:
        engine.open_rollout()

        async def run():
            task = asyncio.create_task(_chats(server, ["1+1="], max_tokens=4))
            await asyncio.sleep(0.3)
            assert not task.done()  # queued: no worker has taken it
            engine.fail("the worker serving the episodes failed: boom")
            with pytest.raises(openai.InternalServerError, match="boom"):
                await task
        asyncio.run(run())
        s = server.sessions.open(tag=0)
        r = httpx.post(server.url + TAKE_ROUTE, json={"wait_s": 0}, headers={"Authorization": f"Bearer {s.key}"})
        assert r.status_code == 403 and "server's key" in r.json()["error"]["message"]
        r = httpx.post(server.url + TAKE_ROUTE, json={"wait_s": "soon"},
                       headers={"Authorization": f"Bearer {server.api_key}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "wait_s"
        engine.close_rollout()
        r = httpx.post(server.url + TAKE_ROUTE, json={"wait_s": 0}, headers={"Authorization": f"Bearer {server.api_key}"})
        assert r.json() == {"requests": [], "closed": True}
    finally:
        server.stop()
        engine.close()
