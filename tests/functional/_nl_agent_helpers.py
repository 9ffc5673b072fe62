"""Agent programs for the agent tests, written only against an OpenAI client (as a user's would be)."""

from __future__ import annotations

import asyncio
import itertools

_episodes = itertools.count()  # in the environment actor's process: episodes run so far


async def two_turns(client, row):
    """Asks, then asks again with its own reply and a follow-up in the history (the turns join into one
    training row), rewarded 1 every other episode. Every 6th episode raises and every 9th hangs, whatever the problem."""
    k = next(_episodes)
    if k % 6 == 5:
        raise ValueError("this agent fails on purpose")
    if k % 9 == 4:
        await asyncio.sleep(30)
    messages = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "="}]
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    # A reward with spread in every group (the untrained model never answers right; a group's episodes
    # run one after another in the count): GRPO trains on it.
    return {"reward": float(k % 2), "turns": 2}
