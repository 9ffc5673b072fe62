"""Typed experiment config: YAML files with `defaults:` inheritance and Hydra-style overrides.

Everything is validated here, before Ray starts, so a typo costs a second and not a cluster start.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_like.algorithms.advantages import estimator_needs, get_advantage_estimator
from nemo_like.algorithms.loss_functions import ClippedPGLossConfig, check_loss_name
from nemo_like.config_sections import (
    BootstrapConfig,
    ClusterConfig,
    DataConfig,
    GRPOConfig,
    RewardModelRewardConfig,
)
from nemo_like.data.datasets import GENERATOR_KINDS
from nemo_like.data.processors import PROCESSOR_REGISTRY
from nemo_like.environments.env_config import validate_env_config
from nemo_like.environments.registry import ENV_REGISTRY, env_config_model, get_env_class
from nemo_like.models.critic.config import CriticConfig
from nemo_like.models.generation.backends import backend_capabilities
from nemo_like.models.policy.backends import POLICY_BACKENDS
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.pretrained import check_model_source
from nemo_like.utils.checkpoint import CheckpointingConfig
from nemo_like.utils.logger import LoggerConfig

# policy.model_name of a config whose model the bootstrap builds (any name after the colon).
BOOTSTRAP_MODEL_PREFIX = "bootstrap:"


class ConfigError(ValueError):
    """A bad config file, key or value. The CLI prints it on one line and exits with code 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _is_bootstrapped_model(name: str, cache_dir: str | None) -> bool:
    """``name`` is a model the bootstrap built (a folder in its cache, as a saved run's config
    records it once setup resolved the placeholder): resuming that run keeps the bootstrap on."""
    cache = Path(cache_dir or BootstrapConfig.model_fields["cache_dir"].get_default(call_default_factory=True))
    try:
        return Path(name).expanduser().resolve().parent == cache.expanduser().resolve()
    except (OSError, ValueError):
        return False


def import_user_modules(modules: Any, where: str = "imports") -> None:
    """Import each module named in ``modules`` (``my_pkg.envs``), so the ``register_env`` /
    ``register_policy_loss`` / ... calls in it take effect before the rest of the config is checked.
    The current directory is searched too, as ``python -m`` would. ValueError naming the module."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) and m.strip() for m in modules):
        raise ValueError(f"{where}: expected a list of module names (my_pkg.envs), got {modules!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name.strip())
        except Exception as e:  # ImportError, or anything the module raised while registering
            raise ValueError(f"{where}: cannot import {name!r}: {type(e).__name__}: {e}") from None


class UserImports(_Strict):
    """The ``imports:`` key of a top-level config (this one and the gym trainer's)."""

    # Modules imported before everything else is checked: where a user's environments, losses,
    # estimators and backends are registered (the CLI's --import adds to it).
    imports: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _user_modules_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("imports"):
            import_user_modules(data["imports"])
        return data


class MasterConfig(UserImports):
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: ClippedPGLossConfig = ClippedPGLossConfig()
    policy: PolicyConfig  # the model that is trained, its workers, optimizer and generation
    data: DataConfig  # the training and validation datasets and how prompts are cut
    # Options of each environment by its registered name (env.math.timeout_s, env.reward_fn.reward_fns),
    # checked against the environment's config model; a dataset's env_name picks the entry it gets.
    env: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"math": {}})
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()
    # Build and SFT the embedded tiny model when policy.model_name is "bootstrap:<name>" (the default run).
    bootstrap: BootstrapConfig | None = None
    # A value model (PPO): its own worker group on cluster.critic; `critic: {}` takes the policy's model.
    critic: CriticConfig | None = None
    # A trained reward model whose score joins the environments' rewards; its own workers (cluster.reward_model).
    reward_model: RewardModelRewardConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _own_model_turns_bootstrap_off(cls, data: Any) -> Any:
        """A ``policy.model_name`` of the user's (hub id, folder, ``gguf:``) wins over the embedded
        tiny model: the bootstrap is turned off, with a printed line, never swapped in silently."""
        if not isinstance(data, dict):
            return data

        def get(section: Any, key: str, default: Any = None) -> Any:  # a YAML mapping or a built model
            return section.get(key, default) if isinstance(section, dict) else getattr(section, key, default)

        boot, name = data.get("bootstrap"), get(data.get("policy"), "model_name")
        boot_on = boot is not None and bool(get(boot, "enabled", True))
        if not isinstance(name, str):
            return data
        if name.startswith(BOOTSTRAP_MODEL_PREFIX):
            if not boot_on:
                raise ValueError(f"policy.model_name: {name!r} names the embedded tiny model, which only the "
                                 "bootstrap builds, and bootstrap is off: set bootstrap.enabled=true, or name "
                                 "your model (a hub id, a model folder or gguf:<file>)")
            return data
        if not boot_on or _is_bootstrapped_model(name, get(boot, "cache_dir")):
            return data
        print(f"[nemo_like] policy.model_name={name}: training that model; bootstrap.enabled set to false "
              "(the embedded tiny model is not built)", file=sys.stderr)
        boot = dict(boot) if isinstance(boot, dict) else boot.model_dump()
        return dict(data) | {"bootstrap": boot | {"enabled": False}}

    @model_validator(mode="before")
    @classmethod
    def _schedule_spans_the_run(cls, data: Any) -> Any:
        """``scheduler.total_steps: auto`` (``policy.`` or ``critic.``): that model's optimizer steps over
        the run, so a decay still ends at the last step when ``grpo.max_num_steps`` or a batch size is
        overridden. The critic trains every step (its warm-up too), ``critic.ppo_epochs`` passes each."""
        if not isinstance(data, dict):
            return data
        g = data.get("grpo") or {}
        if not isinstance(g, dict):
            g = g.model_dump()

        def get(d: dict, model: type[BaseModel], key: str) -> Any:
            return d[key] if key in d else model.model_fields[key].default

        for section in ("policy", "critic"):
            part = data.get(section)
            sched = part.get("scheduler") if isinstance(part, dict) else None
            if not isinstance(sched, dict) or sched.get("total_steps") != "auto":
                continue
            try:
                completions = int(get(g, GRPOConfig, "num_prompts_per_step")) * int(
                    get(g, GRPOConfig, "num_generations_per_prompt"))
                gbs = part.get("train_global_batch_size") if section == "critic" else None
                gbs = gbs or data["policy"]["train_global_batch_size"]
                passes = int(part.get("ppo_epochs", 1)) if section == "critic" else 1
                per_step = max(1, completions // int(gbs)) * passes
                # At least one step past warmup: a run of 0 steps (validation only) still validates.
                total = max(int(get(g, GRPOConfig, "max_num_steps")) * per_step, int(sched.get("warmup_steps", 0)) + 1)
            except (KeyError, TypeError, ValueError):
                continue  # the fields' own validation names what is wrong
            data = dict(data)
            data[section] = dict(part) | {"scheduler": dict(sched) | {"total_steps": total}}
        return data

    @model_validator(mode="after")
    def _consistent_batches(self) -> MasterConfig:
        g, p = self.grpo, self.policy
        per_step = g.num_prompts_per_step * g.num_generations_per_prompt
        gbs = p.train_global_batch_size
        if gbs % g.num_generations_per_prompt:
            raise ValueError(
                f"policy.train_global_batch_size ({gbs}) is not divisible by grpo.num_generations_per_prompt "
                f"({g.num_generations_per_prompt}): a global batch must hold whole groups")
        if per_step % gbs:
            raise ValueError(
                f"grpo.num_prompts_per_step ({g.num_prompts_per_step}) x grpo.num_generations_per_prompt "
                f"({g.num_generations_per_prompt}) = {per_step} completions per step is not a multiple of "
                f"policy.train_global_batch_size ({gbs})")
        if gbs % self.cluster.num_workers:
            raise ValueError(f"policy.train_global_batch_size ({gbs}) is not divisible by "
                             f"cluster.num_workers ({self.cluster.num_workers})")
        if self.data.max_input_seq_length >= p.max_total_sequence_length:
            raise ValueError(
                f"data.max_input_seq_length ({self.data.max_input_seq_length}) leaves no room to generate within "
                f"policy.max_total_sequence_length ({p.max_total_sequence_length})")
        if self.checkpointing.enabled and self.checkpointing.metric_name and self.checkpointing.metric_name.startswith(
                "val/") and self.grpo.val_period and self.checkpointing.save_period % self.grpo.val_period:
            # Top-k by a validation metric needs that metric at each save.
            raise ValueError(
                f"checkpointing.save_period ({self.checkpointing.save_period}) must be a multiple of "
                f"grpo.val_period ({self.grpo.val_period}) to rank checkpoints by "
                f"{self.checkpointing.metric_name}")
        if self.bootstrap is None or not self.bootstrap.enabled:
            # A missing, corrupt or unsupported model file fails here, before Ray starts.
            for key in ("model_name", "tokenizer_name"):
                name = getattr(p, key)
                if name:
                    check_model_source(name, key=f"policy.{key}")
        for name, options in self.env.items():
            self._check_env_options(name, options)
        self._check_env_datasets()
        try:  # the loss and the advantage estimator by name from their registries, as setup builds them
            check_loss_name(self.loss_fn.name)
        except KeyError as e:
            raise ValueError(f"loss_fn.name: {e.args[0]}") from None
        try:
            get_advantage_estimator(self.grpo.advantage_estimator)
        except KeyError as e:
            raise ValueError(f"grpo.advantage_estimator: {e.args[0]}") from None
        self._check_generation()
        self._check_critic()
        self._check_policy_backend()
        self._check_async()
        self._check_roles()
        weights = [d.sampling_weight for d in self.data.train_list]
        if any(w is not None for w in weights) and any(w is None for w in weights):
            missing = [d.task_name for d in self.data.train_list if d.sampling_weight is None]
            raise ValueError(f"data.train: sampling_weight is set on some datasets but not on those of tasks "
                             f"{missing}; set it on every train dataset or on none")
        return self

    def _check_generation(self) -> None:
        g = self.policy.generation
        if g.colocated:  # the training workers generate; the backend's name was checked as "hf"
            return
        try:  # imports the worker class: a separate rollout group will need it anyway
            caps = backend_capabilities(g.backend)
        except (KeyError, ImportError, TypeError) as e:
            raise ValueError(f"policy.generation.backend: {e.args[0]}") from None
        # What the backend cannot do is refused now, not when the first rollout reaches it.
        if g.refit_transport == "collective" and "collective_refit" not in caps:
            raise ValueError(f"policy.generation.refit_transport=collective: backend {g.backend!r} does not take a "
                             "broadcast refit (no 'collective_refit' capability); use refit_transport=object_store")
        if g.stream_episodes and g.engine == "continuous" and "streaming" not in caps:
            raise ValueError(f"policy.generation.stream_episodes: backend {g.backend!r} cannot stream episodes "
                             "(no 'streaming' capability); set policy.generation.stream_episodes=false")

    def _check_critic(self) -> None:
        name = self.grpo.advantage_estimator
        needs = estimator_needs(name)
        if "values" in needs and self.critic is None:
            raise ValueError(f"grpo.advantage_estimator={name!r} needs a critic's values: add a critic section "
                             "(critic: {} trains a value model on the policy's model)")
        if self.critic is not None and "values" not in needs:
            raise ValueError(f"critic is set, but grpo.advantage_estimator={name!r} uses no values: set "
                             "grpo.advantage_estimator=gae, or remove the critic section")
        if self.critic is not None:
            self.critic.passes_config(self.policy)  # its packing / token budgets, under the policy's rules
        if "greedy_rewards" in needs and (self.grpo.dynamic_sampling.enabled or self.grpo.async_rollouts.enabled):
            raise ValueError(f"grpo.advantage_estimator={name!r} grades one greedy sample per prompt of the step: "
                             "it does not combine with grpo.dynamic_sampling or grpo.async_rollouts")

    def _check_policy_backend(self) -> None:
        name = self.policy.backend
        try:
            cls = POLICY_BACKENDS.get(name)  # imports a non-default backend's worker module
        except KeyError as e:
            raise ValueError(f"policy.backend: {e.args[0]}") from None
        except ImportError as e:
            raise ValueError(f"policy.backend={name!r}: {e}") from None
        # A worker class may refuse settings it does not implement, before any actor starts.
        check = getattr(cls, "check_config", None)
        if check is not None:
            check(self.policy)

    def run_roles(self) -> dict[str, bool]:
        """Which roles this run has (cluster.roles' keys): setup places them, the checks below pool them."""
        return {"policy": True, "generation": not self.policy.generation.colocated,
                "reference": self.loss_fn.reference_policy_kl_penalty > 0 or self.grpo.kl_in_reward.enabled,
                "critic": self.critic is not None, "reward_model": self.reward_model is not None}

    def _check_roles(self) -> None:
        """With cluster.resource_pools: each role this run has on a pool, and only those."""
        used = self.run_roles()
        needs_gpu = {"policy": "policy.backend=megatron"} if self.policy.backend == "megatron" else {}
        self.cluster.check_roles(used, needs_gpu, concurrent_generation=self.grpo.async_rollouts.enabled,
                                 collective_refit=self.policy.generation.refit_transport == "collective")

    def _check_async(self) -> None:
        a = self.grpo.async_rollouts
        if not a.enabled:
            return
        if self.policy.generation.colocated:
            raise ValueError("grpo.async_rollouts.enabled needs a rollout group that generates while the trainer "
                             "trains: set policy.generation.colocated=false (and cluster.generation.*)")
        if not self.loss_fn.use_importance_sampling_correction:
            raise ValueError("grpo.async_rollouts.enabled trains on samples of older weights: set "
                             "loss_fn.use_importance_sampling_correction=true (the decoupled objective; "
                             "loss_fn.truncated_importance_sampling_ratio caps its weight)")
        if self.grpo.dynamic_sampling.enabled:
            raise ValueError("grpo.async_rollouts.enabled with grpo.dynamic_sampling.enabled is not supported "
                             "yet: set grpo.dynamic_sampling.enabled=false")

    def _check_env_datasets(self) -> None:
        """Each dataset against the environment that grades it (``check_dataset``: e.g. a prompt that
        never asks for the answer format the grader reads), for environments registered now."""
        for where, datasets in (("train", self.data.train_list), ("validation", self.data.validation_list)):
            for ds in datasets:
                processor = ds.processor or ds.env_name
                if processor not in PROCESSOR_REGISTRY:
                    default = "" if ds.processor else " (a dataset's processor defaults to its env_name)"
                    raise ValueError(f"data.{where}.processor (task {ds.task_name!r}): no data processor {processor!r} "
                                     f"is registered{default}; set data.{where}.processor=math for prompt-only rows "
                                     f"graded by your environment, or register_processor({processor!r}, ...); "
                                     f"registered: {PROCESSOR_REGISTRY.names()}")
                check = getattr(get_env_class(ds.env_name), "check_dataset", None) if ds.env_name in ENV_REGISTRY else None
                if check is None:
                    continue
                model = env_config_model(ds.env_name)
                options = validate_env_config(ds.env_name, model, self.env.get(ds.env_name, {})) if model else None
                try:
                    check(ds, options)
                except ValueError as e:
                    raise ValueError(f"data.{where} (task {ds.task_name!r}): {e}") from None

    @staticmethod
    def _check_env_options(name: str, options: dict[str, Any]) -> None:
        """``env.<name>`` against the environment's declared ``config_model``, so a typo or a bad
        type fails now, naming the key, and not inside an actor after the cluster started."""
        try:
            model = env_config_model(name)
        except ImportError as e:
            raise ValueError(f"env.{name}: {e}") from None
        if model is not None:
            validate_env_config(name, model, options)  # ValueError naming env.<name>.<key>


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml_with_defaults(path: str | Path, _seen: tuple = ()) -> dict:
    """`defaults: other.yaml` (or a list) names files, relative to this one, that this file overrides."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: `defaults` cycle through {' -> '.join(map(str, _seen))}")
    data = _read_yaml(path)
    defaults = data.pop("defaults", None) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged: dict = {}
    for d in defaults:
        merged = _deep_merge(merged, load_yaml_with_defaults(path.parent / d, _seen + (path,)))
    return _deep_merge(merged, data)


def _nested_model(field: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X``, ``X | None``, ``X | list[X]``), if any."""
    ann = field.annotation
    sub = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
    return sub[0] if sub else None


def schema_field(keys: list[str], schema: type[BaseModel] | None = None) -> Any:
    """The field of the config schema (``MasterConfig`` unless given) at ``keys`` (``["grpo",
    "dynamic_sampling", "enabled"]``), or None where the schema has none (a missing key, or a key
    under a free-form mapping)."""
    model: type[BaseModel] | None = schema or MasterConfig
    field = None
    for k in keys:
        field = model.model_fields.get(k) if model is not None else None
        if field is None:
            return None
        model = _nested_model(field)
    return field


def _schema_has(keys: list[str], schema: type[BaseModel] | None = None) -> bool:
    """``keys`` name a field of the schema, or lie under a free-form mapping (``env.<name>.<option>``),
    or name a key of a section that takes the options of what it selects (``loss_fn.<option>``, checked
    when the config is validated)."""
    for i in range(1, len(keys) + 1):
        field = schema_field(keys[:i], schema)
        if field is None:
            parent = _nested_model(schema_field(keys[:i - 1], schema)) if i > 1 else (schema or MasterConfig)
            return i == len(keys) and parent is not None and parent.model_config.get("extra") == "allow"
        if _nested_model(field) is None and getattr(field.annotation, "__origin__", None) is dict:
            return True
    return True


def _schema_fields(keys: list[str], schema: type[BaseModel] | None = None) -> list[str]:
    """Field names the schema has at ``keys`` (for a did-you-mean when the YAML has no such section)."""
    field = schema_field(keys, schema) if keys else None
    model = (schema or MasterConfig) if not keys else _nested_model(field) if field is not None else None
    return list(model.model_fields) if model is not None else []


def apply_overrides(cfg: dict, overrides: list[str], schema: type[BaseModel] | None = None) -> dict:
    """`a.b=value` sets a key that the YAML or the schema (``MasterConfig`` unless given) knows;
    `++a.b=value` may add any key. Values are parsed as YAML (`3` int, `true` bool, `null` None,
    `[1,2]` list)."""
    for ov in overrides:
        force = ov.startswith("++")
        body = ov[2:] if force else ov
        if "=" not in body:
            raise ConfigError(f"override {ov!r}: expected key=value")
        key, raw = body.split("=", 1)
        parts = key.strip().split(".")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = cfg
        for i, k in enumerate(parts[:-1]):
            if not isinstance(node.get(k), dict):
                if k in node and node[k] is not None and not force:
                    raise ConfigError(f"override {ov!r}: {'.'.join(parts[:i + 1])} is not a mapping")
                node[k] = {}
            node = node[k]
        present = parts[-1] in node
        if not (present or force or _schema_has(parts, schema)):
            close = difflib.get_close_matches(parts[-1], list(node) + _schema_fields(parts[:-1], schema), n=1)
            hint = f" (did you mean {'.'.join(parts[:-1] + close)}?)" if close else ""
            raise ConfigError(f"override {ov!r}: unknown config key {key!r}{hint}; use ++{key}=... to add it")
        node[parts[-1]] = value
    return cfg


def _readable_loc(loc: tuple) -> str:
    """``data.train.generator.reasoning_gym.dataset`` -> ``data.train.generator.dataset``: pydantic
    puts a union's tag or branch type in the location; the user wrote neither."""
    out: list[str] = []
    for x in map(str, loc):
        if x.startswith("function-") or (out and out[-1] == "generator" and x in GENERATOR_KINDS):
            continue
        out.append(x)
    return ".".join(out)


def format_validation_error(e: ValidationError) -> str:
    errors = e.errors()
    # `x: A | list[A]` reports a bad A twice: as A, and as "not a list". Keep the first where both are.
    branch = [err for err in errors if any(str(x).startswith("list[") for x in err["loc"])]
    if len(branch) < len(errors):
        errors = [err for err in errors if err not in branch]
    parts = []
    for err in errors:
        loc = _readable_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown config key"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
        # A section's own validator may already name the full key (loss_fn.tau: ...).
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc + ".") else msg)
    return "; ".join(parts)


def validate_config(cfg: dict) -> MasterConfig:
    try:
        return MasterConfig.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {format_validation_error(e)}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> MasterConfig:
    raw, rest = with_imports(load_yaml_with_defaults(path), list(overrides or []))
    return validate_config(apply_overrides(raw, rest))


IMPORT_PREFIX = "imports+="


def with_imports(raw: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """``imports+=my_pkg.envs`` overrides (the CLI's ``--import``) appended to the YAML's ``imports:``
    list, which the config imports first when it is validated; returns the other overrides."""
    extra = [o.removeprefix(IMPORT_PREFIX) for o in overrides if o.startswith(IMPORT_PREFIX)]
    if extra:
        raw = dict(raw, imports=list(raw.get("imports") or []) + extra)
    return raw, [o for o in overrides if not o.startswith(IMPORT_PREFIX)]


def parse_cli(argv: list[str], default_config: str | Path) -> tuple[str, list[str]]:
    """`[--config PATH] [--import MODULE ...] [key=value ...]` -> (config path, overrides); each
    ``--import m`` is an ``imports+=m`` entry of the overrides (see ``with_imports``)."""
    path, overrides, i = str(default_config), [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "--import"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{a} needs a {'path' if a == '--config' else 'module name'}")
            if a == "--config":
                path = argv[i + 1]
            else:
                overrides += [IMPORT_PREFIX + m for m in argv[i + 1].split(",") if m.strip()]
            i += 2
            continue
        if a.startswith("--import="):
            overrides += [IMPORT_PREFIX + m for m in a.split("=", 1)[1].split(",") if m.strip()]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a in ("-h", "--help"):
            raise SystemExit("usage: [--config PATH] [--import MODULE ...] [key=value | ++key=value ...]  "
                             f"(default: {default_config})")
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(f"unexpected argument {a!r}: expected --config PATH or key=value")
        i += 1
    return path, overrides
