"""The reward-model run's config: checked before Ray starts, errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_like.algorithms.rm import load_rm_config
from nemo_like.config import ConfigError

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "rm_math_tiny.yaml"


def test_the_recipe_loads():
    cfg = load_rm_config(CONFIG)
    assert cfg.data.math_pairs.num_train == 8000 and cfg.reward_model.model_name.startswith("bootstrap:")


@pytest.mark.parametrize("overrides, message", [
    (["data.train=pairs.jsonl"], "give either data.train .* or data.math_pairs, not both"),
    (["data.math_pairs=null"], "give either data.train"),
    (["data.math_pairs=null", "data.train=a.jsonl"], "data.validation: a JSONL pair file of held-out pairs"),
    (["reward_model.train_global_batch_size=0"], "reward_model.train_global_batch_size"),
    (["reward_model.lr=1"], "reward_model.lr"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_rm_config(CONFIG, overrides)
