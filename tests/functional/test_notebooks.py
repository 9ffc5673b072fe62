"""The notebooks run top to bottom in a real Jupyter kernel (with tiny settings), and are stored clean."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

TINY = [
    "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_val_samples=8",
    "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
    "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
    "data.train.generator.num_samples=200", "data.validation.generator.num_samples=8",
    "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
    "bootstrap.sft.num_steps=5", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
]


def test_the_notebooks_exist_and_are_stored_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"grpo_quickstart.ipynb", "custom_reward_and_environment.ipynb",
                                           "grpo_gym_quickstart.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} is stored with outputs"


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch, base_model_cache):
    # The kernel inherits this process's environment: tiny model, two steps, files under tmp_path.
    # bootstrap.cache_dir is the session's shared one, as a user's runs share ~/.cache/nemo_like: the
    # TINY base model is built once (by test_grpo_functional in a full run, else by the first notebook),
    # and the custom notebook's two-turn run (max length 64, its own recipe) still builds one in the kernel.
    monkeypatch.setenv("NEMO_LIKE_NB_STEPS", "2")
    monkeypatch.setenv("NEMO_LIKE_NB_OVERRIDES", " ".join([*TINY, f"bootstrap.cache_dir={base_model_cache}"]))
    monkeypatch.setenv("NEMO_LIKE_NB_RUN_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws the figures
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                        for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if path.stem == "grpo_gym_quickstart":  # an agent on CartPole, then an environment written in a cell
        assert "held-out greedy return:" in outputs and "resumed from step_2 at step 2" in outputs
        assert "corridor: train/return_mean" in outputs
    else:
        assert "held-out greedy accuracy" in outputs
    if path.stem == "grpo_quickstart":
        assert "resumed from step_" in outputs and "at step 3" in outputs  # 2 train() steps + 1 step()
        assert any(o.get("data", {}).get("image/png") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    elif path.stem == "custom_reward_and_environment":
        assert "errors counted: 1.0" in outputs
    assert list((tmp_path / "runs").iterdir()), "the notebook wrote its run under NEMO_LIKE_NB_RUN_DIR"
