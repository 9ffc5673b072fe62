"""verifiers environments as a task source (``generator: {kind: verifiers, ...}``).

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ (PyPI ``verifiers``, 0.4: ``import
verifiers.v1 as vf``) environments are a taskset (rows: a prompt and what the task's rewards read), the
agents that play it and how a task becomes an episode. A dataset config names one::

    generator: {kind: verifiers, environment: my-env, split: train, num_samples: 500,
                args: {taskset: {num_tasks: 1000}, agent: {harness: {id: "null"}}}}

``environment`` is an installed environment package (the id verifiers' loader takes: a top-level
module exporting its Taskset) with ``args`` the loader's ``[env]`` settings (``taskset`` knobs, the
``agent``'s harness and runtime...), or a factory ``"pkg.module:load_environment"`` called with ``args``
and returning a ``vf.Env``. An agent without a runtime runs in the ``subprocess`` runtime (verifiers'
default, prime sandboxes, needs their service).

Rows carry ``problem`` (the task's prompt: text, or messages) and what finds the task again
(``vf_env``: the spec as JSON; ``vf_index``: the task's position in the taskset's iteration; ``vf_key``: its
content key), so the ``verifiers`` environment loads the environment once and plays that very task.

verifiers has no splits: ``validation_percent`` of the tasks (by a hash of each task's key) are held
out for the validation split, so train and validation never overlap; 0 keeps every task in both (for
an environment whose args pick its own split).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import random
import sys
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.data.errors import DataError

__all__ = ["VerifiersConfig", "generate_verifiers_dataset", "load_verifiers_env", "verifiers_spec",
           "split_of_task", "spec_label"]


class VerifiersConfig(BaseModel):
    """``data.<split>.generator`` for a verifiers environment's dataset."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["verifiers"]  # which generator this is
    # An installed environment package (what verifiers' load_environment takes) or a factory
    # "pkg.module:load_environment".
    environment: str
    # A factory's keyword arguments; for a package, verifiers' [env] settings (taskset: {its knobs},
    # agent: {harness: {id: ...}, runtime: {type: ...}}, timeout...).
    args: dict[str, Any] = Field(default_factory=dict)
    # Which side of the held-out rule (validation_percent) the rows come from.
    split: Literal["train", "validation"]
    num_samples: int | None = Field(default=None, gt=0)  # tasks to keep (all of a finite taskset when None)
    seed: int = 0  # order of the kept tasks
    # Share of the tasks (by a hash of each task's key) held out as the validation split; 0: every task
    # in both splits (when train and validation args pick different tasks themselves).
    validation_percent: int = Field(default=10, ge=0, lt=100)
    # Folders put first on the import path before the environment loads (a package not installed,
    # e.g. examples/verifiers_env); relative to the working directory.
    paths: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_environment(self) -> VerifiersConfig:
        problem = environment_problem(self.environment, [os.path.abspath(p) for p in self.paths])
        if problem:
            raise ValueError(f"environment: {problem}")
        if ":" not in self.environment and "agent" in self.args and not isinstance(self.args["agent"], dict):
            raise ValueError("args.agent: expected a dict of verifiers agent settings (harness, runtime...)")
        return self


def _module_of(package_id: str) -> str:
    # What verifiers' loader imports for an id: hub ids are owner/name@version, dashes become underscores.
    return package_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def environment_problem(environment: str, paths: list[str]) -> str | None:
    """Why ``environment`` cannot be loaded, found without importing anything (None: it looks loadable)."""
    spec = environment.strip()
    if not spec:
        return "empty; name an installed verifiers environment package or a factory 'pkg.module:load_environment'"
    search = paths + sys.path
    if ":" in spec:
        module, _, attr = spec.partition(":")
        if not module or not attr.isidentifier():
            return f"{spec!r} must look like 'pkg.module:load_environment'"
        top = module.split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, search) is None and top not in sys.modules:
            return f"the factory {spec!r} cannot be imported: no module {top!r} on the import path"
        return None
    module = _module_of(spec)
    if "." in module or not module.isidentifier():
        return (f"{spec!r} is not a verifiers environment id (a top-level package name such as my-env); for "
                "a function inside a package use the factory form 'pkg.module:load_environment'")
    found = importlib.machinery.PathFinder.find_spec(module, search)
    vf = importlib.util.find_spec("verifiers")
    builtin = vf is not None and any(os.path.isdir(os.path.join(d, "v1", "tasksets", module))
                                     for d in vf.submodule_search_locations or [])
    if found is None and not builtin and module not in sys.modules:
        return (f"no verifiers environment package {spec!r} is installed (no module {module!r}); install it "
                "(`uv pip install <its folder or name>`), or add its folder to paths")
    return None


def verifiers_spec(cfg: VerifiersConfig) -> str:
    """The environment a row comes from, as JSON (what the environment actor loads)."""
    return json.dumps({"environment": cfg.environment.strip(), "args": cfg.args,
                       "paths": [os.path.abspath(p) for p in cfg.paths]}, sort_keys=True, default=str)


def spec_label(spec_json: str) -> str:
    try:
        return str(json.loads(spec_json)["environment"])
    except (ValueError, KeyError, TypeError):
        return spec_json[:80]


_ENVS: dict[str, Any] = {}
_ENV_LOCK = threading.Lock()


def load_verifiers_env(spec_json: str) -> Any:
    """The ``vf.Env`` a spec names, loaded once per process. Raises ``DataError`` in one line naming the
    environment when it cannot be loaded (an unknown package, a factory that fails or returns no Env)."""
    with _ENV_LOCK:
        if spec_json in _ENVS:
            return _ENVS[spec_json]
        spec = json.loads(spec_json)
        label = spec["environment"]
        for p in reversed(spec.get("paths") or []):
            if p not in sys.path:
                sys.path.insert(0, p)
        try:
            import verifiers.v1 as vf
        except ImportError as e:
            raise DataError(f"verifiers environment {label!r}: verifiers is not installed ({e}); "
                            "`uv sync --extra verifiers`") from None
        try:
            env = _build(vf, label, dict(spec.get("args") or {}))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"verifiers environment {label!r}: {first_line(e)}") from None
        _ENVS[spec_json] = env
        return env


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


def _build(vf: Any, label: str, args: dict[str, Any]) -> Any:
    if ":" in label:
        from nemo_like.utils.registry import import_from_path

        factory = import_from_path(label, what="verifiers environment factory")
        if not callable(factory):
            raise DataError(f"verifiers environment {label!r}: is a {type(factory).__name__}, not a function")
        made = factory(**args)
        if isinstance(made, (vf.EnvConfig, dict)):
            made = vf.load_environment(vf.resolve_env_config(made))
        if not isinstance(made, vf.Env):
            raise DataError(f"verifiers environment {label!r}: the factory returned a {type(made).__name__}, "
                            "not a verifiers Env (e.g. vf.SingleAgentEnv(config)) or an EnvConfig")
        return made
    config = {**args, "taskset": {**(args.get("taskset") or {}), "id": label}}
    # verifiers' default runtime is a remote prime sandbox; here the agent runs on this machine unless
    # the args say otherwise.
    agent = dict(config.get("agent") or {})
    agent.setdefault("runtime", {"type": "subprocess"})
    config["agent"] = agent
    return vf.load_environment(vf.resolve_env_config(config))


class TaskList:
    """A taskset's tasks by position, read lazily from its iterator (tasksets may be infinite)."""

    def __init__(self, env: Any):
        self._iter = iter(env.taskset)
        self._tasks: list[Any] = []
        self._done = False
        self._lock = threading.Lock()

    def get(self, index: int) -> Any | None:
        with self._lock:
            while len(self._tasks) <= index and not self._done:
                try:
                    self._tasks.append(next(self._iter))
                except StopIteration:
                    self._done = True
            return self._tasks[index] if index < len(self._tasks) else None


def split_of_task(key: str, validation_percent: int) -> Literal["train", "validation", "both"]:
    if validation_percent <= 0:
        return "both"
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") % 100 < validation_percent else "train"


def _problem(data: Any) -> str | list[dict[str, str]]:
    """The task's prompt as the trainer shows it: its text, or its messages (system prompt first)."""
    prompt = data.prompt
    if isinstance(prompt, str) and not data.system_prompt:
        return prompt
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        from verifiers.v1.types import content_text

        for m in prompt or []:
            messages.append({"role": str(m.role), "content": content_text(m.content) or ""})
    return messages


def generate_verifiers_dataset(cfg: VerifiersConfig) -> Any:
    """Rows of the environment's tasks on ``cfg.split``'s side of the held-out rule, ``num_samples`` of
    them (all of a finite taskset when None) in an order fixed by ``cfg.seed``: a ``datasets.Dataset``
    with ``problem``, ``expected_answer`` (the task's ``answer`` field when it has one), ``vf_env``,
    ``vf_index``, ``vf_key``. Raises DataError naming the environment."""
    import datasets

    spec = verifiers_spec(cfg)
    env = load_verifiers_env(spec)
    label = cfg.environment
    infinite = not env.taskset.bounded
    if infinite and cfg.num_samples is None:
        raise DataError(f"verifiers environment {label!r}: its taskset is infinite; set num_samples")
    cap = None if not infinite else cfg.num_samples * 100 // max(1, 100 - cfg.validation_percent) * 4 + 100
    picked: list[tuple[int, Any]] = []  # (position in the taskset's iteration: what TaskList.get finds, task)
    try:
        for n, task in enumerate(env.taskset):
            if cap is not None and n >= cap:
                break
            if split_of_task(task.key, cfg.validation_percent) in (cfg.split, "both"):
                picked.append((n, task))
                if infinite and len(picked) == cfg.num_samples:
                    break
    except Exception as e:
        raise DataError(f"verifiers environment {label!r}: its taskset failed to load: {first_line(e)}") from None
    if not infinite:
        random.Random(cfg.seed).shuffle(picked)
        if cfg.num_samples is not None:
            picked = picked[: cfg.num_samples]
    if not picked or (infinite and len(picked) < (cfg.num_samples or 0)):
        raise DataError(f"verifiers environment {label!r}: {len(picked)} tasks on the {cfg.split} side "
                        f"(validation_percent={cfg.validation_percent}); it needs more tasks")
    positions = [n for n, _ in picked]
    picked_tasks = [t for _, t in picked]
    problems = [_problem(t.data) for t in picked_tasks]
    if any(isinstance(p, list) for p in problems):  # one column type: every problem as messages
        problems = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in problems]
    answers = [getattr(t.data, "answer", None) for t in picked_tasks]
    return datasets.Dataset.from_dict({
        "problem": problems,
        "expected_answer": ["" if a is None else str(a) for a in answers],
        "vf_env": [spec] * len(picked),
        # The position, not the task's own idx: a taskset view (include, skip, shuffle) keeps the idx of
        # load(), and the environment actor finds tasks by position.
        "vf_index": positions,
        "vf_key": [t.key for t in picked_tasks],
    })
