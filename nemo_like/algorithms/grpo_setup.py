"""What `setup()` (grpo_run.py) builds a run from, apart from the trainer: datasets per task, their
sampler, each environment's constructor config, and the check that a checkpoint belongs to this
recipe. Also used by the SFT bootstrap and the benchmarks, which must not import the trainer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nemo_like.config import ConfigError, MasterConfig, schema_field
from nemo_like.data.sampler import EpochSampler, MixtureSampler
from nemo_like.environments.env_config import TRAINER_SIDE_KEYS

__all__ = ["dump_config", "check_resume_compatible", "run_identity", "RUN_IDENTITY_FILE", "MODEL_KEYS", "make_train_sampler", "build_task_dataset", "env_config",
           "check_prompt_lengths"]


def dump_config(config: MasterConfig) -> dict:
    return json.loads(config.model_dump_json())


# Sections a resumed run may change: how long to train and how to log/save/place it, not what.
# A schedule's length follows a longer run (total_steps: auto): the lr is recomputed from the new length.
_RESUMABLE_CHANGES = ("grpo.max_num_steps", "grpo.max_num_epochs", "grpo.max_duration_s", "grpo.val_period",
                      "grpo.val_at_start",
                      "policy.scheduler.total_steps", "policy.sequence_packing.", "policy.dynamic_batching.",
                      "policy.logprob_batch_size", "policy.generation_batch_size",
                      "grpo.reuse_generation_logprobs", "grpo.logprob_check_period", "grpo.skip_inert_samples",
                      "grpo.max_consecutive_env_failures", "grpo.env_step_timeout_s", "grpo.stop_on_collapse.",
                      "grpo.val_at_end", "grpo.max_val_samples", "logger.", "checkpointing.", "cluster.",
                      "bootstrap.cache_dir", "grpo.success_threshold")
# The models a run trains, as the user named them: the saved run_config.json holds them resolved (a
# gguf: file's converted folder, the bootstrap's cache folder, a template file's text), so they are compared as given, from
# RUN_IDENTITY_FILE. A checkpoint written before that file existed cannot tell, and is not refused for them.
MODEL_KEYS = ("policy.model_name", "policy.tokenizer_name", "critic.model_name", "reward_model.model_name",
              "teacher.model_name",
              "policy.chat_template")  # (a template is saved as its text, named as given)
# Beside run_config.json in each checkpoint: the model names as given and the data files' contents.
RUN_IDENTITY_FILE = "run_identity.json"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_identity(config: MasterConfig) -> dict[str, Any]:
    """What makes a run this run beyond its config's values: the model names as the user gave them
    (``config`` before any resolution) and the sha256 of every local data file it reads, so that a
    file edited in place is not resumed as if it were the same data."""
    flat = _flat(dump_config(config))
    files: dict[str, str] = {}
    for ds in config.data.train_list + config.data.validation_list:
        path = Path(ds.path) if ds.path and not ds.path.startswith("hf:") else None
        if path is not None and path.is_file():
            files[ds.path] = _file_digest(path)
    return {"models": {k: flat.get(k) for k in MODEL_KEYS}, "data_files": files}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.")
    return out


_NO_DEFAULT = object()


def _schema_default(dotted: str) -> Any:
    """The schema's default for a flattened key ("grpo.dynamic_sampling.enabled"), as JSON would
    hold it; ``_NO_DEFAULT`` for a key without one (e.g. under a free-form mapping)."""
    field = schema_field(dotted.split("."))
    if field is None:
        return _NO_DEFAULT
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return _NO_DEFAULT
    return json.loads(json.dumps(value.model_dump() if isinstance(value, BaseModel) else value))


def check_resume_compatible(config: MasterConfig, checkpoint: Path, identity: dict[str, Any] | None = None) -> None:
    """Refuse to resume a checkpoint written by a run with a different recipe (model, data, loss,
    batch sizes...): continuing it silently would train something nobody asked for. ``config`` as the
    user gave it (model names unresolved); ``identity``: this run's ``run_identity`` (None: computed)."""
    saved_path = checkpoint / "run_config.json"
    if not saved_path.exists():
        return
    saved, now = _flat(json.loads(saved_path.read_text())), _flat(dump_config(config))
    identity = run_identity(config) if identity is None else identity
    saved_identity_path = checkpoint / RUN_IDENTITY_FILE
    saved_identity = json.loads(saved_identity_path.read_text()) if saved_identity_path.exists() else None
    for k in MODEL_KEYS:
        if saved_identity is None:  # an older checkpoint: its names are resolved, not comparable
            saved.pop(k, None)
            now.pop(k, None)
        else:
            saved[k], now[k] = saved_identity["models"].get(k), identity["models"].get(k)
    # A key the saved run never had (added to the schema since) is the same recipe at its default.
    added_at_default = {k for k in set(now) - set(saved) if _schema_default(k) == now[k]}
    differ = [f"{k} ({saved.get(k)!r} -> {now.get(k)!r})"
              for k in sorted((set(saved) | set(now)) - added_at_default)
              if saved.get(k) != now.get(k) and not any(k == p or k.startswith(p) for p in _RESUMABLE_CHANGES)]
    if saved_identity is not None:
        before = saved_identity.get("data_files", {})
        differ += [f"data file {f} (its contents changed since the checkpoint)"
                   for f, digest in identity["data_files"].items() if f in before and before[f] != digest]
    if differ:
        shown = ", ".join(differ[:5])
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        d = config.checkpointing.checkpoint_dir
        raise ConfigError(f"checkpointing.checkpoint_dir={d} holds another run, not resumed: {shown}{more}. "
                          f"To start this run there, set checkpointing.resume=false (the earlier checkpoints move to "
                          f"{d}/previous_<N>/); or give it its own checkpointing.checkpoint_dir and logger.log_dir")


def make_train_sampler(ds_cfgs, dataset, seed: int) -> EpochSampler | MixtureSampler:
    """Epochs over all train rows, or a weighted mixture when the datasets set ``sampling_weight``."""
    weights = [c.sampling_weight for c in ds_cfgs]
    if any(w is None for w in weights):  # all or none: MasterConfig checks it
        return EpochSampler(len(dataset), seed=seed)
    return MixtureSampler([len(p) for p in getattr(dataset, "parts", [dataset])], weights, seed=seed)


def build_task_dataset(ds_cfgs, rows_list, tokenizer, max_seq_length: int, *, sft: bool = False):
    """Rows of each dataset config -> DatumSpecs through its task's processor; several datasets are
    served as one (a multi-task run)."""
    from nemo_like.data.interfaces import TaskDataSpec
    from nemo_like.data.processors import AllTaskProcessedDataset, ConcatTaskDataset, get_processor

    parts = []
    for ds_cfg, rows in zip(ds_cfgs, rows_list, strict=True):
        spec = TaskDataSpec(task_name=ds_cfg.task_name, prompt=ds_cfg.prompt, system_prompt=ds_cfg.system_prompt,
                            few_shot=ds_cfg.few_shot_turns())
        try:
            proc = get_processor(ds_cfg.processor or ds_cfg.env_name, sft=sft)
        except KeyError as e:
            raise ConfigError(f"data (task {ds_cfg.task_name!r}).processor: {e.args[0]}") from None
        parts.append(AllTaskProcessedDataset(rows, tokenizer, spec, {ds_cfg.task_name: (spec, proc)},
                                             max_seq_length=max_seq_length))
    return parts[0] if len(parts) == 1 else ConcatTaskDataset(parts)


def env_config(cfg: MasterConfig, ds_cfg) -> dict[str, Any]:
    """``env.<env_name>`` plus the dataset's own reward functions (checked here, before any actor
    starts, so a typo in an import path is a config error, not a run of zero rewards)."""
    from nemo_like.environments.reward_fn_environment import get_reward_fn

    out = {k: v for k, v in cfg.env.get(ds_cfg.env_name, {}).items() if k not in TRAINER_SIDE_KEYS}
    if ds_cfg.reward_fns:
        for i, r in enumerate(ds_cfg.reward_fns):
            try:
                get_reward_fn(r.fn)
            except (ImportError, KeyError, TypeError) as e:
                raise ConfigError(f"data (task {ds_cfg.task_name!r}).reward_fns[{i}].fn: {e}") from e
        out["reward_fns"] = [r.model_dump() for r in ds_cfg.reward_fns]
    return out


def check_prompt_lengths(ds_cfgs, rows_list, tokenizer, split: str, max_input: int, max_cut_frac: float,
                         *, max_rows: int = 2000) -> int:
    """Count the prompts longer than ``data.max_input_seq_length`` (they would be cut, and carry no
    loss): raise a ConfigError when more than ``max_cut_frac`` of them are, else print a line when
    any are. Renders every row up to ``max_rows``, then ``max_rows`` spread evenly. Returns the
    number cut among the rows rendered."""
    full = build_task_dataset(ds_cfgs, rows_list, tokenizer, 2**31 - 1)  # nothing cut: true lengths
    n = len(full)
    rows = range(n) if n <= max_rows else sorted({i * n // max_rows for i in range(max_rows)})
    lengths = [int(full[i]["length"]) for i in rows]
    cut = [x for x in lengths if x > max_input]
    if not cut:
        return 0
    share = len(cut) / len(lengths)
    what = (f"{len(cut)} of {len(lengths)} {split} prompts{' rendered' if n > max_rows else ''} are longer than "
            f"data.max_input_seq_length={max_input} tokens (the longest is {max(cut)})")
    if share > max_cut_frac:
        raise ConfigError(f"{what}; cut prompts carry no loss, and {share:.1%} is over data.max_cut_prompt_frac="
                          f"{max_cut_frac:g}. Raise data.max_input_seq_length to {max(cut)} (and "
                          "policy.max_total_sequence_length with it), or shorten the prompt template")
    print(f"[nemo_like] {what}: they are cut and carry no loss (train/prompt_cut_frac counts them per step)")
    return len(cut)


def check_critic_tokenizer(critic_model: str, policy_tokenizer: str, trust_remote_code: bool = False) -> None:
    """A critic of another model must tokenize as the policy does (its values are read per policy
    token): ConfigError naming ``critic.model_name`` otherwise, before Ray starts."""
    check_same_tokenizer(critic_model, policy_tokenizer, "critic.model_name",
                         "a critic reads the policy's tokens; use a model of the same family, or leave "
                         "critic.model_name unset (the policy's model)", trust_remote_code)


def check_same_tokenizer(model: str, policy_tokenizer: str, key: str, why: str, trust_remote_code: bool = False) -> None:
    """ConfigError naming ``key`` when ``model``'s tokenizer has another vocabulary than the policy's."""
    from transformers import AutoTokenizer

    try:
        mine = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ConfigError(f"{key}={model!r}: cannot load its tokenizer: {e}") from None
    theirs = AutoTokenizer.from_pretrained(policy_tokenizer, trust_remote_code=trust_remote_code)
    if mine.get_vocab() != theirs.get_vocab():
        raise ConfigError(f"{key}={model!r} has another tokenizer than the policy's ({policy_tokenizer!r}): "
                          f"{len(mine)} against {len(theirs)} tokens; {why}")
