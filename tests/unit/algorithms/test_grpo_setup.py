"""Resume compatibility: a checkpoint written before a config key existed still resumes while the
key holds its default, and is refused as soon as the key changes the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_like.algorithms.grpo_setup import check_resume_compatible, dump_config
from nemo_like.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_tiny.yaml"
PLAIN = ["grpo.dynamic_sampling.enabled=false", "grpo.dynamic_sampling.max_gen_batches=4"]  # the schema's defaults


def _older_checkpoint(tmp_path: Path) -> Path:
    saved = dump_config(load_config(TINY, PLAIN))
    del saved["grpo"]["dynamic_sampling"], saved["loss_fn"]["policy_loss"], saved["loss_fn"]["name"]
    (tmp_path / "run_config.json").write_text(json.dumps(saved))
    return tmp_path


def test_keys_added_since_the_checkpoint_resume_at_their_defaults(tmp_path):
    ckpt = _older_checkpoint(tmp_path)
    check_resume_compatible(load_config(TINY, PLAIN), ckpt)  # same recipe: the new keys hold their defaults
    check_resume_compatible(load_config(TINY, [*PLAIN, "grpo.max_num_steps=90"]), ckpt)  # a longer run is fine
    with pytest.raises(ConfigError, match=r"different config: grpo.dynamic_sampling.enabled \(None -> True\)"):
        check_resume_compatible(load_config(TINY, ["grpo.dynamic_sampling.enabled=true"]), ckpt)
    with pytest.raises(ConfigError, match=r"loss_fn.policy_loss \(None -> 'gspo'\)"):
        check_resume_compatible(load_config(TINY, [*PLAIN, "loss_fn.policy_loss=gspo"]), ckpt)
