"""SFT batch making: length grouping keeps every sample exactly once and pads far less."""

from __future__ import annotations

import random

from nemo_like.algorithms.sft_loop import _batches
from nemo_like.data.sampler import EpochSampler


def test_group_by_length_serves_each_sample_once_in_similar_length_batches():
    rng = random.Random(0)
    data = [{"id": i, "length": rng.choice([30, 60, 110]) + rng.randrange(5)} for i in range(64)]
    plain = _batches(data, EpochSampler(64, seed=1), 8, False, random.Random(1))
    grouped = _batches(data, EpochSampler(64, seed=1), 8, True, random.Random(1))
    plain_batches = [next(plain) for _ in range(8)]
    grouped_batches = [next(grouped) for _ in range(8)]
    for batches in (plain_batches, grouped_batches):
        assert sorted(d["id"] for b in batches for d in b) == list(range(64))  # one epoch, nothing lost
        assert all(len(b) == 8 for b in batches)

    def padded_tokens(batches):
        return sum(len(b) * max(d["length"] for d in b) for b in batches)

    assert padded_tokens(grouped_batches) < 0.8 * padded_tokens(plain_batches)
    # batches are served in shuffled order, not shortest first
    maxima = [max(d["length"] for d in b) for b in grouped_batches]
    assert maxima != sorted(maxima)


def test_bootstrap_cache_key_names_the_recipe_not_its_spelling():
    import os

    from nemo_like.config import load_config
    from nemo_like.models.bootstrap import bootstrap_cache_path

    cfg_path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "configs", "grpo_math_tiny.yaml")

    def key(*overrides):
        return bootstrap_cache_path(load_config(cfg_path, list(overrides))).name

    # The key names the number of SFT workers, not where it is set: bootstrap.num_workers (2 in this
    # config) or, when that is unset, cluster.num_workers.
    assert key() == key("bootstrap.num_workers=null", "cluster.num_workers=2", "cluster.cpus_per_worker=1")
    assert key("bootstrap.num_workers=1") != key()
    assert key("bootstrap.sft.num_steps=651") != key()
    assert key("data.train.sampling_weight=3") == key()  # a GRPO-only setting
    # A setting added later joins the key only when it differs from the default that built the caches.
    assert key("bootstrap.sft.lr_decay=constant") == key()
    assert key("bootstrap.sft.lr_decay=cosine") != key()


def test_bootstrap_cache_key_follows_the_tool_table_only_for_tool_data(monkeypatch):
    import os

    from nemo_like.config import load_config
    from nemo_like.environments import tools
    from nemo_like.models.bootstrap import bootstrap_cache_path

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "configs")
    multi = load_config(os.path.join(configs, "grpo_multi_env_tiny.yaml"))
    math = load_config(os.path.join(configs, "grpo_math_tiny.yaml"))
    before = bootstrap_cache_path(multi), bootstrap_cache_path(math)
    monkeypatch.setitem(tools.LOOKUP_TABLE, "zzzz", 1)  # the table changed: tool rows would too
    assert bootstrap_cache_path(multi) != before[0]
    assert bootstrap_cache_path(math) == before[1]
