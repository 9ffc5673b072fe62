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


def test_prompts_too_long_are_counted_and_many_refuse_the_run(capsys):
    from nemo_like.algorithms.grpo_setup import check_prompt_lengths
    from nemo_like.config import ConfigError
    from nemo_like.data.datasets import DatasetConfig, load_dataset_from_config
    from nemo_like.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = DatasetConfig(generator={"split": "train", "num_samples": 100, "seed": 0, "max_value": 999})
    rows = load_dataset_from_config(cfg)
    lengths = sorted(len(tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True), add_special_tokens=False)["input_ids"])
                     for p in rows["problem"])
    # A limit every prompt fits: nothing said.
    assert check_prompt_lengths([cfg], [rows], tok, "train", lengths[-1], 0.02) == 0
    assert capsys.readouterr().out == ""
    # The longest prompts over the limit, allowed by the share: counted and said.
    limit = lengths[-1] - 1
    n_over = sum(x > limit for x in lengths)
    assert 0 < n_over < 100
    assert check_prompt_lengths([cfg], [rows], tok, "train", limit, 1.0) == n_over
    assert (f"{n_over} of 100 train prompts are longer than data.max_input_seq_length={limit} tokens "
            f"(the longest is {lengths[-1]})") in capsys.readouterr().out
    # Most prompts over: refused, naming the key and the length that fits.
    with pytest.raises(ConfigError, match=rf"data.max_cut_prompt_frac=0.02. Raise data.max_input_seq_length to "
                                          rf"{lengths[-1]}"):
        check_prompt_lengths([cfg], [rows], tok, "train", lengths[0] - 1, 0.02)
