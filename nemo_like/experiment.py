"""`GRPOExperiment`: a GRPO run you drive from a notebook (or a script) one step at a time.

    exp = GRPOExperiment.from_config("examples/configs/grpo_math_tiny.yaml", overrides=["grpo.num_prompts_per_step=16"])
    exp.validate(); exp.train(steps=20); exp.step()
    exp.metrics; exp.plot(["train/reward_mean", "val/accuracy"]); exp.samples(n=4); exp.generate(["12+34="])
    exp.add_reward_fn(my_fn, weight=1.0, task="math")
    exp.save(); exp2 = GRPOExperiment.resume(exp.checkpoint_dir)
    exp.close()   # or `with GRPOExperiment(...) as exp:`

It wraps the same `GRPOTrainer` the CLI uses (`grpo_train` is the only training loop), keeps Ray,
the policy workers and the environment actors alive between calls, and frees what it started on
`close()`. Building a new experiment closes any experiment still open in this process first, so
re-running a notebook cell neither leaks actors nor waits forever for CPUs the old one holds.

Reward functions added from code live in the constructor arguments of their task's actor (a new
actor is built with the whole list on every change), so they survive Ray restarting that actor
(a crash, or a step past its time limit). They are also listed in
``<checkpoint_dir>/experiment_reward_fns.json``: a resumed experiment adds back the ones importable by
path (or given by registered name) and warns about the others (lambdas, functions of a notebook,
``__main__`` or a function body), which must be added again.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_like.algorithms.grpo_setup import RUN_IDENTITY_FILE
from nemo_like.config import ConfigError, MasterConfig, apply_overrides, load_config, validate_config
from nemo_like.experience.samples import sample_rows

__all__ = ["GRPOExperiment", "LiveExperiment"]

_OPEN: list[weakref.ref] = []  # experiments not yet closed, oldest first
# In checkpoint_dir, beside the step_<N> folders: the reward functions added from code, for resume.
REWARD_FNS_FILE = "experiment_reward_fns.json"


def close_open_experiments() -> None:
    """Close every experiment (language-model or gym) still open in this process: a notebook cell
    run again must neither leak actors nor wait forever for the CPUs the old one holds."""
    for ref in list(_OPEN):
        old = ref()
        if old is not None and not old.closed:
            print("[nemo_like] closing the previous experiment first (one live experiment per process)")
            old.close()
    _OPEN[:] = [r for r in _OPEN if r() is not None and not r().closed]


def track_open_experiment(exp: Any) -> None:
    """Remember ``exp`` (which has ``closed`` and ``close()``) for :func:`close_open_experiments`."""
    _OPEN.append(weakref.ref(exp))


def _import_path(fn: Any) -> str | None:
    """``"module:name"`` that imports back to ``fn`` in a fresh process, or None: a lambda, a closure,
    a method, or a function of ``__main__`` (a script or a notebook cell) cannot be found by path."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None
    if not qualname.isidentifier():  # "<lambda>", "f.<locals>.g", "Class.method"
        return None
    try:
        found = getattr(importlib.import_module(module), qualname)
    except Exception:  # noqa: BLE001 - any failure means "not restorable"
        return None
    return f"{module}:{qualname}" if found is fn else None


def _restorable_ref(fn: Callable | str) -> str | None:
    """What a fresh process can resolve ``fn`` from: an import path, else the registered name it was
    given by (built-in names are registered on import), else None."""
    from nemo_like.environments.reward_fn_environment import get_reward_fn

    if isinstance(fn, str) and ("." in fn or ":" in fn):
        return fn
    return _import_path(get_reward_fn(fn)) or (fn if isinstance(fn, str) else None)


def _label(spec: dict) -> str:
    fn = spec["fn"]
    where = fn if isinstance(fn, str) else getattr(fn, "__qualname__", type(fn).__name__)
    return f"{spec['name']!r} ({where})" if spec.get("name") else repr(where)


class LiveExperiment:
    """What both notebook APIs share (``GRPOExperiment``, ``GymGRPOExperiment``): construction from a
    YAML path and resume from a checkpoint folder, ``close()`` and ``with``, and the refusal to run
    on after ``close()``. A subclass sets ``self.trainer`` (with ``close()``) and ``self.closed``."""

    trainer: Any
    closed: bool = True

    @classmethod
    def from_config(cls, path: str | Path, overrides: Sequence[str] | None = None, **kwargs: Any) -> Any:
        return cls(path, overrides, **kwargs)

    @classmethod
    def resume(cls, checkpoint_dir: str | Path, overrides: Sequence[str] | None = None) -> Any:
        """Continue the run whose checkpoints are in ``checkpoint_dir`` from its latest checkpoint,
        with the config it was saved with (plus ``overrides``, e.g. a longer ``grpo.max_num_steps``)."""
        from nemo_like.utils.checkpoint import CheckpointManager

        checkpoint_dir = Path(checkpoint_dir)
        latest = CheckpointManager({"checkpoint_dir": str(checkpoint_dir)}, cleanup_stale=False).get_latest_checkpoint_path()
        if latest is None or not (latest / "run_config.json").exists():
            raise FileNotFoundError(f"{checkpoint_dir} holds no complete checkpoint with a run_config.json to resume")
        saved = json.loads((latest / "run_config.json").read_text())
        saved["checkpointing"]["checkpoint_dir"] = str(checkpoint_dir)
        given = latest / RUN_IDENTITY_FILE  # the model names as the run was given them (saved ones are resolved)
        if given.exists():
            for key, name in json.loads(given.read_text())["models"].items():
                section, field = key.split(".")
                if isinstance(saved.get(section), dict):
                    saved[section][field] = name
        return cls(saved, overrides, resume=True)

    def close(self) -> None:
        """Free the workers and actors this experiment created (and Ray, if it started it)."""
        if self.closed:
            return
        self.closed = True
        self.trainer.close()

    def _check_open(self) -> None:
        if self.closed:
            name = type(self).__name__
            raise RuntimeError(f"this experiment is closed; build a new one (or {name}.resume(...))")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _to_config(config: MasterConfig | str | Path | dict, overrides: Sequence[str] | None) -> MasterConfig:
    overrides = list(overrides or [])
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    if isinstance(config, MasterConfig):
        if not overrides:
            return config.model_copy(deep=True)
        config = json.loads(config.model_dump_json())
    if isinstance(config, dict):
        return validate_config(apply_overrides(dict(config), overrides))
    raise TypeError(f"config must be a YAML path, a dict or a MasterConfig, got {type(config).__name__}")


class GRPOExperiment(LiveExperiment):
    """A live GRPO run: Ray, policy workers and environment actors stay up between calls."""

    def __init__(self, config: MasterConfig | str | Path | dict, overrides: Sequence[str] | None = None, *,
                 resume: bool | None = None):
        """``config``: a YAML path, a dict or a MasterConfig, with ``overrides`` ("key=value", as on the
        command line). ``resume``: None follows ``checkpointing.resume`` ("auto": continue the newest
        checkpoint in checkpoint_dir when it is this run's, refuse one of another model, data or
        recipe); False starts fresh (an earlier run's checkpoints move to ``previous_<N>/``); True
        continues (``GRPOExperiment.resume(dir)`` does that with the saved config)."""
        from nemo_like.algorithms.grpo_run import setup
        from nemo_like.utils.checkpoint import CheckpointManager, resume_wanted

        cfg = _to_config(config, overrides)
        resuming = resume_wanted(cfg.checkpointing, resume) and cfg.checkpointing.enabled and CheckpointManager(
            cfg.checkpointing, cleanup_stale=False).get_latest_checkpoint_path() is not None
        close_open_experiments()
        self.closed = False
        # task -> its reward functions ({fn, weight, name}), for tasks whose functions were changed
        # from code; the task's actor was built with exactly this list.
        self._reward_fns: dict[str, list[dict[str, Any]]] = {}
        self.trainer = setup(cfg, resume=resume)
        track_open_experiment(self)
        if resuming:
            self._restore_reward_fns()
        elif cfg.checkpointing.enabled:  # a fresh run: a list left by an earlier run is not this run's
            Path(cfg.checkpointing.checkpoint_dir, REWARD_FNS_FILE).unlink(missing_ok=True)

    # ---- training ----------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One GRPO step; its metrics (validation included when the step is on ``val_period``)."""
        self._check_open()
        return self.trainer.step()

    @property
    def stop_reason(self) -> str | None:
        """Why training stopped early (a collapse signature and its step; grpo.stop_on_collapse), or None.
        ``train`` returns early once it is set; ``step`` still runs if you want to look further."""
        return self.trainer.stop_reason

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """``steps`` more GRPO steps (None: up to ``grpo.max_num_steps``) with a progress bar;
        validates first when nothing has been trained yet. Returns the metrics of those steps."""
        from nemo_like.algorithms.grpo import grpo_train

        self._check_open()
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be a non-negative int or None, got {steps!r}")
        return grpo_train(self.trainer, max_steps=steps)

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out set now (logged at the current step)."""
        self._check_open()
        return self.trainer.validate(log=True)

    # ---- rewards ---------------------------------------------------------------------------------
    def _tasks(self) -> list[str]:
        return sorted({c.task_name for c in self.config.data.train_list + self.config.data.validation_list})

    def _task(self, task: str | None) -> str:
        tasks = self._tasks()
        if task is None:
            if len(tasks) != 1:
                raise ValueError(f"this run has several tasks {tasks}: name one with task=...")
            return tasks[0]
        if task not in tasks:
            raise KeyError(f"no task {task!r} in this run; tasks: {tasks}")
        return task

    def add_reward_fn(self, fn: Callable | str, weight: float = 1.0, task: str | None = None,
                      name: str | None = None) -> list[str]:
        """Grade ``task`` with ``fn(completions, **columns) -> list[float | None]`` (weighted, summed
        with the other functions added to it). The first function added to a task replaces the
        task's environment by a reward-function environment (add ``"math_accuracy"`` too to keep
        rewarding correct answers). Returns the task's function names."""
        from nemo_like.environments.reward_fn_environment import get_reward_fn

        self._check_open()
        task = self._task(task)
        get_reward_fn(fn)  # a clear error here, not inside the actor
        replacing = task not in self._reward_fn_tasks()
        names = self._set_reward_fns(task, self._task_reward_fns(task) + [{"fn": fn, "weight": weight, "name": name}])
        if replacing:
            print(f"[nemo_like] task {task!r} is now graded by reward functions instead of its environment")
        return names

    def clear_reward_fns(self, task: str | None = None) -> None:
        """Forget the reward functions of ``task`` (its samples are unscorable until one is added)."""
        self._check_open()
        task = self._task(task)
        if task not in self._reward_fn_tasks():
            raise ValueError(f"task {task!r} is graded by an environment, not reward functions")
        self._set_reward_fns(task, [])

    def _reward_fn_tasks(self) -> set[str]:
        """Tasks whose actor is a RewardFnEnvironment (from the config, or made so by add_reward_fn)."""
        tasks = set(self._reward_fns)
        for c in self.config.data.train_list + self.config.data.validation_list:
            if self._configured_reward_fns(c.task_name) is not None:
                tasks.add(c.task_name)
        return tasks

    def _configured_reward_fns(self, task: str) -> list[dict[str, Any]] | None:
        """The reward functions the config gives ``task``, or None when it is graded by another environment."""
        from nemo_like.algorithms.grpo_setup import env_config
        from nemo_like.environments.registry import get_env_class
        from nemo_like.environments.reward_fn_environment import RewardFnEnvironment

        ds_cfg = next(c for c in self.config.data.train_list + self.config.data.validation_list if c.task_name == task)
        if not issubclass(get_env_class(ds_cfg.env_name), RewardFnEnvironment):
            return None
        return list(env_config(self.config, ds_cfg).get("reward_fns") or [])

    def _task_reward_fns(self, task: str) -> list[dict[str, Any]]:
        if task in self._reward_fns:
            return list(self._reward_fns[task])
        return self._configured_reward_fns(task) or []

    def _set_reward_fns(self, task: str, specs: list[dict[str, Any]]) -> list[str]:
        """Grade ``task`` by a new actor built with ``specs`` (so a restart rebuilds them: Ray keeps
        an actor's constructor arguments, callables included); returns its function names."""
        import ray

        from nemo_like.environments.registry import create_env_actor
        from nemo_like.environments.reward_fn_environment import RewardFnEnvironment
        from nemo_like.environments.supervision import wait_for_env_actors

        options = {k: v for k, v in self.config.env.get("reward_fn", {}).items() if k != "reward_fns"}
        config = {**options, "reward_fns": [dict(s) for s in specs]}
        RewardFnEnvironment(config)  # a bad weight or name fails here, before the task's actor is replaced
        actor = create_env_actor("reward_fn", config)
        try:  # the functions reached the actor (cloudpickle: a module the worker cannot import fails here)
            wait_for_env_actors({task: actor}, {task: "reward_fn"})
            names = ray.get(actor.reward_fn_names.remote(), timeout=60)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        self.trainer.set_env(task, actor, env_name="reward_fn")  # env.reward_fn.step_timeout_s applies
        self._reward_fns[task] = [dict(s) for s in specs]
        self._save_reward_fns()
        return names

    def _save_reward_fns(self) -> None:
        """The functions of each changed task, as a fresh process can find them (``ref`` None: it
        cannot), written atomically to ``<checkpoint_dir>/experiment_reward_fns.json``."""
        if not self.config.checkpointing.enabled:
            return
        tasks = {task: [{"ref": _restorable_ref(s["fn"]), "label": _label(s), "weight": s.get("weight", 1.0),
                         "name": s.get("name")} for s in specs] for task, specs in self._reward_fns.items()}
        path = Path(self.checkpoint_dir, REWARD_FNS_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"tasks": tasks}, indent=1))
        os.replace(tmp, path)

    def _restore_reward_fns(self) -> None:
        """After a resume: add back the functions a fresh process can import; warn about the rest."""
        path = Path(self.checkpoint_dir, REWARD_FNS_FILE)
        try:
            saved = json.loads(path.read_text())["tasks"] if path.exists() else {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"{path}: unreadable ({e!r}); reward functions added from code were not restored",
                          stacklevel=3)
            return
        known = self._tasks()
        lost: list[str] = []
        for task, entries in saved.items():
            if task not in known:
                continue
            keep = [{"fn": e["ref"], "weight": e["weight"], "name": e["name"]} for e in entries if e.get("ref")]
            missing = [e["label"] for e in entries if not e.get("ref")]
            if missing:
                lost.append(f"task {task!r}: {', '.join(missing)}" + ("" if keep else " (until then it is graded as "
                                                                                   "configured)"))
                if not keep:
                    continue
            try:
                names = self._set_reward_fns(task, keep)
                print(f"[nemo_like] task {task!r}: reward functions restored: {names}")
            except Exception as e:  # noqa: BLE001 - e.g. a module deleted since: say so, go on as configured
                warnings.warn(f"reward functions of task {task!r} not restored ({e}); it is graded as configured",
                              stacklevel=3)
        if lost:
            warnings.warn("reward functions added with add_reward_fn were not restored, since they cannot be "
                          "imported by path (a lambda, or a function defined in a notebook, __main__ or inside "
                          f"another function): {'; '.join(lost)}. Add them again with exp.add_reward_fn(...).",
                          stacklevel=3)

    # ---- looking at the run ----------------------------------------------------------------------
    @property
    def config(self) -> MasterConfig:
        return self.trainer.config

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    @property
    def checkpoint_dir(self) -> str:
        return self.config.checkpointing.checkpoint_dir

    @property
    def metrics(self):
        """One row per step (training and validation metrics of a step merged), as in metrics.jsonl."""
        import pandas as pd

        rows: dict[int, dict[str, Any]] = {}
        for h in self.trainer.history:
            rows.setdefault(int(h["step"]), {}).update(h)
        df = pd.DataFrame([rows[s] for s in sorted(rows)])
        return df.set_index("step", drop=False) if not df.empty else df

    def plot(self, keys: Sequence[str] | str = ("train/reward_mean", "val/accuracy")):
        """A matplotlib figure with one panel per metric name."""
        from nemo_like.utils.plotting import plot_metrics

        return plot_metrics(self.trainer.history, [keys] if isinstance(keys, str) else list(keys))

    def samples(self, n: int | None = 4, *, sort: str | None = None, split: str = "train"):
        """The last step's samples (``split="val"``: the last validation's, greedy): task, problem,
        completion, reward, advantage, ground truth... ``sort="best"``/``"worst"`` orders them by
        reward first."""
        import pandas as pd

        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        batch = self.trainer.last_batch if split == "train" else self.trainer.last_val_batch
        if batch is None:
            raise RuntimeError("no step has run yet: call step() or train() first" if split == "train" else
                               "no validation has run yet: call validate() first")
        rows = sample_rows(batch)
        df = pd.DataFrame(rows)
        if sort in ("best", "worst"):
            df = df.sort_values("reward", ascending=sort == "worst", kind="stable")
        elif sort is not None:
            raise ValueError(f"sort must be None, 'best' or 'worst', got {sort!r}")
        return df if n is None else df.head(n)

    def generate(self, prompts: Sequence[str] | str, task: str | None = None, *, greedy: bool = True) -> list[str]:
        """Completions of the current policy for raw problems, rendered as the task's prompts are."""
        from nemo_like.data.collate import rl_collate_fn
        from nemo_like.distributed.batched_data_dict import BatchedDataDict
        from nemo_like.experience.rollouts import flatten_message_logs

        self._check_open()
        if isinstance(prompts, str):
            prompts = [prompts]
        task = self._task(task)
        data = [self._datum(p, task, i) for i, p in enumerate(prompts)]
        flat = flatten_message_logs(rl_collate_fn(data)["message_log"], self.trainer.tokenizer.pad_token_id)
        gen = self.trainer.policy.generate(BatchedDataDict(input_ids=flat["input_ids"],
                                                           input_lengths=flat["input_lengths"]), greedy=greedy)
        out = []
        for j in range(len(prompts)):
            start, end = int(flat["input_lengths"][j]), int(gen["unpadded_sequence_lengths"][j])
            out.append(self.trainer.tokenizer.decode(gen["output_ids"][j, start:end].tolist(), skip_special_tokens=True))
        return out

    def _datum(self, problem: str, task: str, idx: int):
        from nemo_like.data.interfaces import TaskDataSpec
        from nemo_like.data.processors import get_processor, math_data_processor

        ds_cfg = next(c for c in self.config.data.train_list + self.config.data.validation_list if c.task_name == task)
        spec = TaskDataSpec(task_name=task, prompt=ds_cfg.prompt, system_prompt=ds_cfg.system_prompt,
                            few_shot=ds_cfg.few_shot_turns())
        row = {"problem": problem, "expected_answer": ""}
        try:
            proc = get_processor(ds_cfg.processor or ds_cfg.env_name)
            return proc(row, spec, self.trainer.tokenizer, self.config.policy.max_total_sequence_length, idx)
        except (KeyError, ValueError, TypeError):  # a processor that needs more columns than a problem
            return math_data_processor(row, spec, self.trainer.tokenizer, self.config.policy.max_total_sequence_length, idx)

    # ---- saving and closing ----------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint now (model, optimizer, data order, RNG, step); returns its folder."""
        self._check_open()
        path = self.trainer.save_checkpoint(self.trainer.history[-1] if self.trainer.history else None)
        if path is None:
            raise ConfigError("checkpointing.enabled is false: nothing to save to")
        return path

    def save_plot(self, path: str | Path | None = None) -> Path:
        """The reward/accuracy curves as a PNG (default: ``<logger.log_dir>/curves.png``)."""
        from nemo_like.utils.plotting import save_training_curves

        return save_training_curves(self.trainer.history, path or Path(self.config.logger.log_dir) / "curves.png")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step_count}"
        tasks = sorted({c.task_name for c in self.config.data.train_list})
        return f"GRPOExperiment({state}, tasks={tasks}, model={self.config.policy.model_name!r})"
