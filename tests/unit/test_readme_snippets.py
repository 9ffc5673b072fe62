"""The README's snippets run as written: the reward functions example on the default config's math
rows, and the complete config of one's own data (examples/configs/grpo_your_data.yaml)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from nemo_like.algorithms.grpo_setup import env_config
from nemo_like.config import load_config
from nemo_like.data.datasets import load_dataset_from_config
from nemo_like.environments.reward_fn_environment import RewardFnEnvironment

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DEFAULT = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def test_the_readme_reward_fns_snippet_grades_the_default_math_rows(tmp_path, monkeypatch):
    block = re.search(r"```yaml\n(data:\n  train: \{reward_fns: .*?)```", README, re.S)
    assert block, "the README no longer shows a reward_fns example"
    module, fn = re.search(r'fn: "([\w.]+):(\w+)"', block.group(1)).groups()
    pkg = tmp_path / module.split(".")[0]
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (tmp_path / (module.replace(".", "/") + ".py")).write_text(
        f"def {fn}(completions, **columns):\n    return [float(len(c) < 40) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mine.yaml").write_text(f"defaults: {DEFAULT}\n{block.group(1)}")
    cfg = load_config(tmp_path / "mine.yaml")  # the default's rows say env_name: math
    assert [d.env_name for d in cfg.data.train_list + cfg.data.validation_list] == ["reward_fn", "reward_fn"]
    ds = cfg.data.train_list[0]
    env = RewardFnEnvironment(env_config(cfg, ds))
    right = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "\\boxed{42}"}]
    wrong = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "\\boxed{41}"}]
    out = env.step([right, wrong], [{"ground_truth": "42"}, {"ground_truth": "42"}])
    # weight 0.5 x (short: 1) + math_accuracy (1 right, 0 wrong)
    assert torch.allclose(out.rewards, torch.tensor([1.5, 0.5]))
    sys.modules.pop(module, None)


def test_the_your_data_config_reads_its_rows_without_an_answer_column(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config names its files and module from the repository root
    cfg = load_config(ROOT / "examples" / "configs" / "grpo_your_data.yaml")
    train, val = cfg.data.train_list[0], cfg.data.validation_list[0]
    for ds in (train, val):  # nothing of the parent's arithmetic task leaks in
        assert (ds.generator, ds.system_prompt, ds.few_shot, ds.prompt) == (None, None, None, None)
        assert (ds.env_name, ds.task_name) == ("reward_fn", "word_count")
    assert cfg.checkpointing.checkpoint_dir == "results/grpo_your_data"
    assert cfg.logger.log_dir == "logs/grpo_your_data"
    rows = load_dataset_from_config(train)
    assert len(rows) == 144 and set(rows["expected_answer"]) == {""}
    env = RewardFnEnvironment(env_config(cfg, train))
    logs = [[{"role": "user", "content": rows[0]["problem"]}, {"role": "assistant", "content": reply}]
            for reply in ("one two three", "one two three four five six seven eight nine ten")]
    n = rows[0]["num_words"]
    out = env.step(logs, [{"num_words": n}, {"num_words": n}])
    assert torch.allclose(out.rewards, torch.tensor([max(0.0, 1 - abs(3 - n) / n), max(0.0, 1 - abs(10 - n) / n)]))


def test_a_function_that_takes_the_answer_still_needs_the_answer_column(tmp_path):
    import pytest

    from nemo_like.data.datasets import DataError, DatasetConfig

    (tmp_path / "rows.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    for fn in ("math_accuracy", "nemo_like.environments.reward_fn_environment:math_accuracy"):
        cfg = DatasetConfig(path=str(tmp_path / "rows.jsonl"), reward_fns=[{"fn": fn}])  # answer_key forgotten
        with pytest.raises(DataError, match=r"missing column 'expected_answer' \(answer_key\) \(a reward function "
                                            r"takes ground_truth"):
            load_dataset_from_config(cfg)
    rows = load_dataset_from_config(DatasetConfig(path=str(tmp_path / "rows.jsonl"), reward_fns=[{"fn": "boxed_format"}]))
    assert rows["expected_answer"] == [""]


def test_a_task_whose_datasets_name_two_graders_says_so():
    import pytest

    # The validation set (task "math", env_name math) is graded by the train set's functions: the
    # task's one actor is the first dataset's.
    with pytest.warns(UserWarning, match=r"data.validation \(task 'math'\) names env_name 'math', but data.train of "
                                         r"the same task 'reward_fn'.* so data.validation is graded by data.train's"):
        load_config(DEFAULT, ['data.train.reward_fns=[{fn: math_accuracy}]'])
