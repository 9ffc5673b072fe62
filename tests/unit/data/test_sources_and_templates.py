"""hf: datasets with a subset and a split (a local folder laid out as a hub repository, read by the real
`datasets.load_dataset(path, name=subset, split=split)`), policy.chat_template (the tokenizer's own, one
given in the config as a string or a file, none: raw text), and a registered environment as env_name
without a processor of its name."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pydantic
import pytest
import torch

from nemo_like.algorithms.grpo_setup import build_task_dataset
from nemo_like.config import ConfigError, load_config
from nemo_like.data import DataError, DatasetConfig, TaskDataSpec, load_dataset_from_config, math_data_processor
from nemo_like.data.chat_templates import CHATML_TEMPLATE, RAW_TEMPLATE, resolve_chat_template
from nemo_like.data.processors import PROCESSOR_REGISTRY, make_datum_spec, register_processor, render_chat
from nemo_like.environments.math_environment import MathEnvironment
from nemo_like.environments.registry import ENV_REGISTRY, register_env
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.tiny import build_char_tokenizer
from nemo_like.models.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
PROMPT = "Solve: {} Answer:"
SYSTEM = "You add numbers."
ROW = {"problem": "12+30=", "expected_answer": "42"}
# A template of the user's own, for a model that has none: "[role] content" lines.
BRACKETS = ("{%- for m in messages -%}{{- '[' + m['role'] + '] ' + m['content'] + '\\n' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}{%- endif -%}")


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    # Only where datasets caches what it prepared moves; the load_dataset call is the one a user's run makes.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _rendered(datum) -> tuple[str, list[int]]:
    log = datum["message_log"]
    return "".join(m["content"] for m in log), torch.cat([m["token_ids"] for m in log]).tolist()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- hf: subset and split
@pytest.fixture
def gsm_like(tmp_path) -> Path:
    """gsm8k's layout: subsets "main" and "socratic", each with train and test splits."""
    root = tmp_path / "gsm_like"
    for subset, rows in (("main", {"train": ("1+1", "2"), "test": ("2+2", "4")}),
                         ("socratic", {"train": ("How much is 3+3?", "6"), "test": ("And 4+4?", "8")})):
        (root / subset).mkdir(parents=True)
        for split, (q, a) in rows.items():
            (root / subset / f"{split}.jsonl").write_text(json.dumps({"question": q, "answer": a}) + "\n")
    (root / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train.jsonl\n"
        f"  - split: test\n    path: {s}/test.jsonl\n" for s in ("main", "socratic")) + "---\n")
    return root


def _gsm(root: Path, **kw) -> DatasetConfig:
    return DatasetConfig(path=f"hf:{root}", problem_key="question", answer_key="answer", **kw)


def test_hf_subset_and_split_pick_the_rows(gsm_like):
    assert load_dataset_from_config(_gsm(gsm_like, subset="main", split="test")).to_list() == [
        {"problem": "2+2", "expected_answer": "4", "task_name": "math"}]
    assert load_dataset_from_config(_gsm(gsm_like, subset="socratic")).to_list() == [
        {"problem": "How much is 3+3?", "expected_answer": "6", "task_name": "math"}]


def test_hf_subset_and_split_errors_name_the_key_to_set(gsm_like):
    with pytest.raises(DataError, match=rf"^hf:{gsm_like}: could not load split 'train' \(ValueError: Config name is "
                                        r"missing.*'main', 'socratic'.*\); set the dataset's subset key to one of "
                                        r"them \(data.train.subset=NAME\)$"):
        load_dataset_from_config(_gsm(gsm_like))
    with pytest.raises(DataError, match=rf"^hf:{gsm_like}: could not load split 'train' of subset 'mian' .*'main', "
                                        r"'socratic'.*; set the dataset's subset key"):
        load_dataset_from_config(_gsm(gsm_like, subset="mian"))
    with pytest.raises(DataError, match=rf"^hf:{gsm_like}: could not load split 'validation' of subset 'main' .*"
                                        r"'train', 'test'.*; set the dataset's split key to one of them"):
        load_dataset_from_config(_gsm(gsm_like, subset="main", split="validation"))
    with pytest.raises(pydantic.ValidationError, match=r"subset='main' selects a subset of an hf: dataset, but path "
                                                       r"is 'data.jsonl'; remove subset"):
        DatasetConfig(path="data.jsonl", subset="main")


# --------------------------------------------------------------------------- policy.chat_template
@pytest.fixture(scope="module")
def bare_tokenizer(tmp_path_factory) -> str:
    """The tiny model's tokenizer saved without a chat template, as a base model's is."""
    folder = tmp_path_factory.mktemp("bare_tokenizer")
    tok = build_char_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(str(folder))
    return str(folder)


def _prompt(tok, system: str | None = SYSTEM):
    return math_data_processor(ROW, TaskDataSpec("math", prompt=PROMPT, system_prompt=system), tok, 256, 0)


def test_a_tokenizer_without_a_template_is_refused_naming_the_key(bare_tokenizer):
    with pytest.raises(ValueError, match=r"^policy.chat_template: the tokenizer of .*bare_tokenizer.* has no chat "
                                         r"template; set policy.chat_template to a jinja template \(a string or the "
                                         r"path of a .jinja file\), 'chatml', or 'raw'"):
        load_tokenizer(bare_tokenizer)
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template; set policy.chat_template"):
        render_chat(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_the_tokenizers_own_template_by_default(model_dir):
    tok = load_tokenizer(model_dir)
    assert tok.chat_template == CHATML_TEMPLATE
    text, ids = _rendered(_prompt(tok))
    assert text == ("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nSolve: 12+30= Answer:"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == _ids(tok, text)


def test_a_template_from_a_file_or_a_string(bare_tokenizer, tmp_path):
    template_file = tmp_path / "brackets.jinja"
    template_file.write_text(BRACKETS)
    expected = "[system] You add numbers.\n[user] Solve: 12+30= Answer:\n[assistant] "
    for setting in (str(template_file), BRACKETS):
        assert PolicyConfig(model_name=bare_tokenizer, chat_template=setting).chat_template == setting
        tok = load_tokenizer(bare_tokenizer, chat_template=setting)
        datum = _prompt(tok)
        text, ids = _rendered(datum)
        assert text == expected
        assert ids == _ids(tok, text)
        assert [m["content"] for m in datum["message_log"]] == ["[system] You add numbers.\n", expected[26:]]
    chatml = load_tokenizer(bare_tokenizer, chat_template="chatml")
    assert _rendered(_prompt(chatml))[0].startswith("<|im_start|>system\nYou add numbers.<|im_end|>\n")


@pytest.mark.parametrize("setting", ["raw", "none", None])
def test_raw_prompts_reach_the_model_as_their_text(bare_tokenizer, setting):
    tok = load_tokenizer(bare_tokenizer, chat_template=setting)
    assert tok.chat_template == RAW_TEMPLATE
    text, ids = _rendered(_prompt(tok, system=None))
    assert text == "Solve: 12+30= Answer:"
    assert ids == _ids(tok, "Solve: 12+30= Answer:")
    # A system prompt is text before the prompt, nothing between (put a newline in it if wanted).
    assert _rendered(_prompt(tok, system="Add.\n"))[0] == "Add.\nSolve: 12+30= Answer:"


def test_a_bad_template_setting_fails_when_the_config_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"policy.chat_template='missing.jinja': not a jinja template \(no '\{%' or "
                                          r"'\{\{' in it\) nor a file \(no such file\); set it to a template, the "
                                          r"path of a .jinja file, 'default'"):
        load_config(TINY, ["policy.chat_template=missing.jinja"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ValueError, match=rf"^policy.chat_template: {broken}:2: jinja syntax error: "):
        resolve_chat_template(str(broken))
    with pytest.raises(ValueError, match=r"^policy.chat_template: the template:1: jinja syntax error"):
        resolve_chat_template("{% if x %}no end")
    assert resolve_chat_template("default") is None
    assert load_config(TINY, ["policy.chat_template=raw"]).policy.chat_template == "raw"


# --------------------------------------------------------------------------- env_name of the user's
def test_a_registered_environment_is_usable_as_env_name_without_a_processor():
    """The notebooks guide's register_env + data.train.env_name=my_task: prompt-only rows (the math
    processor), the environment's name recorded nowhere as a processor."""
    tok = build_char_tokenizer()
    with ENV_REGISTRY.isolated():
        register_env("my_task", MathEnvironment)
        cfg = load_config(TINY, ["data.train.env_name=my_task", "data.validation.env_name=my_task",
                                 "data.train.generator.num_samples=2"])
        train = cfg.data.train_list[0]
        assert (train.env_name, train.processor) == ("my_task", "math")
        rows = load_dataset_from_config(train)
        datum = build_task_dataset([train], [rows], tok, 256)[0]
        spec = TaskDataSpec("math", prompt=train.prompt, system_prompt=train.system_prompt, few_shot=train.few_shot_turns())
        assert _rendered(datum) == _rendered(math_data_processor(rows[0], spec, tok, 256, 0))
        # A processor named as the dataset sets it still has to exist.
        with pytest.raises(ConfigError, match=r"no data processor 'mth' is registered"):
            load_config(TINY, ["data.train.env_name=my_task", "data.train.processor=mth"])


def test_a_processor_registered_under_the_environments_name_is_used():
    def shouting(datum, spec, tokenizer, max_seq_length, idx):
        text = str(datum["problem"]).upper()
        log = [{"role": "user", "content": text, "token_ids": torch.tensor(_ids(tokenizer, text))}]
        return make_datum_spec(log, max_seq_length=max_seq_length, extra_env_info={}, idx=idx, task_name=spec.task_name)

    tok = build_char_tokenizer()
    with PROCESSOR_REGISTRY.isolated():
        register_processor("loud", shouting)
        cfg = DatasetConfig(path="rows.jsonl", env_name="loud")
        assert cfg.processor is None  # its own processor, found by the env_name as before
        datum = build_task_dataset([cfg], [[{"problem": "abc", "expected_answer": "x", "task_name": "math"}]], tok, 64)[0]
        assert datum["message_log"][0]["content"] == "ABC"
