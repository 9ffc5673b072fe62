"""The training server's BatchingEngine: requests that arrive while the server is still parsing
others, or writing the last batch's answers, generate as one batch."""

from __future__ import annotations

import asyncio

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.tiny import build_char_tokenizer
from nemo_like.serve.engines import BatchingEngine, GenParams


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
