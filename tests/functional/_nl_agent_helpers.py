"""Agent programs for the agent tests, written only against an OpenAI client (as a user's would be)."""

from __future__ import annotations

import asyncio


async def answer_once(client, row):
    """One request; reward 1 when the reply contains the answer."""
    r = await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=12)
    return 1.0 if row["ground_truth"] in (r.choices[0].message.content or "") else 0.0


async def two_turns(client, row):
    """Asks, then asks again with its own reply and a follow-up in the history (the turns join into one
    training row); fails on purpose for every fifth problem and hangs for every seventh."""
    n = int(row["ground_truth"]) if str(row["ground_truth"]).lstrip("-").isdigit() else 0
    if n % 5 == 1:
        raise ValueError("this agent fails on purpose")
    if n % 7 == 2:
        await asyncio.sleep(60)
    messages = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "="}]
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return {"reward": 1.0 if row["ground_truth"] in (r.choices[0].message.content or "") else 0.0, "turns": 2}
