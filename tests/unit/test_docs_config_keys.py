"""Every config key the README and the manual name in backticks (`grpo.dynamic_sampling.enabled`,
`policy.lora.rank=8`) is a key of a config schema: the GRPO/PPO run's, the reward-model, DPO or SFT
run's, or the gym run's. A renamed or removed key then fails here, naming the page and line, instead of staying in
the docs. docs/reference/config.md is generated from the schemas and checked by its own test. A table
that maps other frameworks' keys to ours (a column headed ``nemo_like``) is checked in that column only.

Likewise every ``exp.<name>`` the docs call is a method or attribute of the notebook API
(``GRPOExperiment``, ``GymGRPOExperiment``), and ``exp.trainer.<name>`` one of their trainers'."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.dpo import DPOConfig
from nemo_like.algorithms.grpo import GRPOTrainer
from nemo_like.algorithms.rm import RMConfig
from nemo_like.algorithms.sft import SFTConfig
from nemo_like.config import MasterConfig, _schema_has, schema_field
from nemo_like.experiment import GRPOExperiment
from nemo_like.gym.config import GymMasterConfig
from nemo_like.gym.experiment import GymGRPOExperiment
from nemo_like.gym.trainer import GymGRPOTrainer

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("policy", "grpo", "cluster", "data", "env", "logger", "checkpointing", "loss_fn", "critic",
            "reward_model", "bootstrap", "trainer", "teacher", "dpo", "validation")
CODE = re.compile(r"`([^`\n]+)`")
KEY = re.compile(r"^(?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FILE_SUFFIXES = (".py", ".yaml", ".md", ".json", ".jsonl", ".safetensors", ".pt")


TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
OURS = "nemo_like"  # the header of our column in a table of other frameworks' keys


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _checked_text(lines: list[str]):
    """(line number, text to check) of each line: all of it, except in a table with a column headed
    ``nemo_like``, where only that column's cells are ours."""
    ours: list[int] | None = None
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            ours = None
        elif i + 1 < len(lines) and TABLE_RULE.match(lines[i + 1].strip()):  # a table's header row
            header = _cells(line)
            ours = [k for k, c in enumerate(header) if OURS in c.lower()] or None
        elif ours is not None and not TABLE_RULE.match(line.strip()):
            cells = _cells(line)
            yield i + 1, " ".join(cells[k] for k in ours if k < len(cells))
            continue
        yield i + 1, line


def doc_keys(text: str):
    """(line, key) of every dotted config key in a backticked span of ``text``."""
    for lineno, line in _checked_text(text.splitlines()):
        for span in CODE.findall(line):
            for token in re.split(r"[\s,;()\[\]{}:]+", span):
                m = KEY.match(token)
                if m and not token.endswith(FILE_SUFFIXES) and not token[m.end():].startswith(FILE_SUFFIXES):
                    yield lineno, m.group(0)


def _estimator_option_names() -> set[str]:
    """``grpo.*`` keys the registered advantage estimators take as their own options."""
    names = set()
    for name in ADVANTAGE_ESTIMATORS.names():
        model = ADVANTAGE_ESTIMATORS.options(name)
        names |= set(getattr(model, "model_fields", {}) or {})
    return names


def known(key: str) -> bool:
    parts = key.split(".")
    for schema in (MasterConfig, RMConfig, GymMasterConfig, DPOConfig, SFTConfig):
        if not _schema_has(parts, schema):
            continue
        # grpo.* is open for the selected estimator's options: only the registered ones count here.
        if parts[0] == "grpo" and schema_field(parts[:2], schema) is None:
            if parts[1] in _estimator_option_names():
                return True
            continue
        return True
    return False


def test_the_checker_reads_keys_and_knows_the_schemas():
    text = "Set `policy.lora.rank=8` and `policy.nope`; not `reward_model.py` or `examples/configs/x.yaml`."
    assert list(doc_keys(text)) == [(1, "policy.lora.rank"), (1, "policy.nope")]
    table = ("| what | verl | nemo_like |\n|---|---|---|\n| G | `data.train_batch_size` | `grpo.num_prompts_per_step` |\n"
             "\n| a | b |\n|---|---|\n| `data.x` | `policy.y` |")
    assert list(doc_keys(table)) == [(3, "grpo.num_prompts_per_step"), (7, "data.x"), (7, "policy.y")]
    assert known("policy.lora.rank") and known("data.math_pairs.malformed") and known("env.math.num_workers")
    assert not known("policy.nope") and not known("grpo.dynamic_sampling.nope") and not known("critic.lam")
    assert not known("grpo.nope")  # grpo.* is open for estimator options, but only registered ones count


def test_every_config_key_in_the_docs_exists():
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "config.md")]
    unknown = [f"{page.relative_to(ROOT)}:{lineno}: {key}" for page in pages
               for lineno, key in doc_keys(page.read_text()) if not known(key)]
    assert not unknown, "config keys the schemas do not have:\n" + "\n".join(unknown)


EXP_ATTR = re.compile(r"\bexp\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


def _names(*classes: type) -> set[str]:
    """Public names of ``classes``: class attributes and those their methods assign to ``self``."""
    names: set[str] = set()
    for cls in classes:
        for klass in cls.__mro__:
            if klass is object:
                continue
            names |= set(vars(klass))
            try:
                names |= set(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(klass)))
            except (OSError, TypeError):
                pass
    return names


def test_every_exp_attribute_in_the_docs_exists():
    experiment, trainer = _names(GRPOExperiment, GymGRPOExperiment), _names(GRPOTrainer, GymGRPOTrainer)
    assert {"train", "add_reward_fn", "trainer", "stop_reason"} <= experiment and "set_env" in trainer
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = []
    for page in pages:
        for lineno, line in enumerate(page.read_text().splitlines(), start=1):
            for name, inner in EXP_ATTR.findall(line):
                if name not in experiment or (name == "trainer" and inner and inner not in trainer):
                    unknown.append(f"{page.relative_to(ROOT)}:{lineno}: exp.{name}" + (f".{inner}" if inner else ""))
    assert not unknown, "not in the notebook API (nemo_like/experiment.py, nemo_like/gym/experiment.py):\n" + \
        "\n".join(unknown)
