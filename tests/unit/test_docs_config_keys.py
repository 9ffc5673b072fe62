"""Every config key the README and the manual name in backticks (`grpo.dynamic_sampling.enabled`,
`policy.lora.rank=8`) is a key of a config schema: the GRPO/PPO run's, the reward-model run's or the
gym run's. A renamed or removed key then fails here, naming the page and line, instead of staying in
the docs. docs/reference/config.md is generated from the schemas and checked by its own test."""

from __future__ import annotations

import re
from pathlib import Path

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.rm import RMConfig
from nemo_like.config import MasterConfig, _schema_has, schema_field
from nemo_like.gym.config import GymMasterConfig

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("policy", "grpo", "cluster", "data", "env", "logger", "checkpointing", "loss_fn", "critic",
            "reward_model", "bootstrap", "trainer")
CODE = re.compile(r"`([^`\n]+)`")
KEY = re.compile(r"^(?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FILE_SUFFIXES = (".py", ".yaml", ".md", ".json", ".jsonl", ".safetensors", ".pt")


def doc_keys(text: str):
    """(line, key) of every dotted config key in a backticked span of ``text``."""
    for lineno, line in enumerate(text.splitlines(), start=1):
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
    for schema in (MasterConfig, RMConfig, GymMasterConfig):
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
    assert known("policy.lora.rank") and known("data.math_pairs.malformed") and known("env.math.num_workers")
    assert not known("policy.nope") and not known("grpo.dynamic_sampling.nope") and not known("critic.lam")
    assert not known("grpo.nope")  # grpo.* is open for estimator options, but only registered ones count


def test_every_config_key_in_the_docs_exists():
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "config.md")]
    unknown = [f"{page.relative_to(ROOT)}:{lineno}: {key}" for page in pages
               for lineno, key in doc_keys(page.read_text()) if not known(key)]
    assert not unknown, "config keys the schemas do not have:\n" + "\n".join(unknown)
