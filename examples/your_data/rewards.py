"""The reward function of examples/configs/grpo_your_data.yaml: a plain function in the TRL convention,
``fn(completions, **columns) -> list[float | None]``, graded with no answer column.

The YAML imports this module (``imports: [examples.your_data.rewards]``, run from the repository root),
which registers the function by name; the environment actors get the registration too.
"""

from __future__ import annotations

import re

from nemo_like.environments.reward_fn_environment import register_reward_fn

_WORD = re.compile(r"[A-Za-z0-9']+")


@register_reward_fn("exact_word_count")
def exact_word_count(completions: list[str], num_words: list[int], **_columns) -> list[float]:
    """1.0 for a reply of exactly ``num_words`` words (the row's column), less the further it is off:
    ``max(0, 1 - |words - num_words| / num_words)``. Fractional rewards: ``grpo.success_threshold: 1.0``
    makes ``val/accuracy`` the share of exact counts, and ``val/reward_mean`` shows the partial credit."""
    out = []
    for text, n in zip(completions, num_words, strict=True):
        words = len(_WORD.findall(text))
        out.append(max(0.0, 1.0 - abs(words - int(n)) / int(n)))
    return out
