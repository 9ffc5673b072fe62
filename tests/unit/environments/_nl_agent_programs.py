"""Agent functions for test_agent_environment (importable by path, as a user's module would be)."""

from __future__ import annotations

import asyncio
import math


async def echo_length(client, row):
    r = await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    return {"reward": row["k"], "chars": len(r.choices[0].message.content or "")}


async def misbehave(client, row):
    mode = row["mode"]
    if mode == "raise":
        raise RuntimeError("boom")
    if mode == "hang":
        await asyncio.sleep(30)
    if mode == "nan":
        return math.nan
    if mode == "text":
        return "1.0"
    return 0.5


def not_async(client, row):
    return 1.0


async def where(client, row):
    """Asks once; its metrics say which process ran it."""
    import os

    if row.get("die"):
        os._exit(1)  # the actor running it dies, before its other episodes have started
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    return {"reward": float(row["k"]), "pid": float(os.getpid())}
