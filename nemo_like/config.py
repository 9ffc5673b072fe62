"""Typed experiment config: the schema of a language-model run (``MasterConfig``) and its checks;
reading YAML with `defaults:` inheritance and overrides is ``nemo_like.config_loading``'s.

Everything is validated here, before Ray starts, so a typo costs a second and not a cluster start.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_like import config_loading as loading
from nemo_like.algorithms.advantages import estimator_needs, get_advantage_estimator
from nemo_like.algorithms.distillation import TeacherConfig
from nemo_like.algorithms.loss_functions import ClippedPGLossConfig, check_loss_name
from nemo_like.config_loading import (
    IMPORT_PREFIX,
    ConfigError,
    Provenance,
    format_validation_error,
    load_yaml_with_defaults,
    load_yaml_with_provenance,
    parse_cli,
    with_imports,
)
from nemo_like.config_sections import (
    BootstrapConfig,
    ClusterConfig,
    DataConfig,
    GRPOConfig,
    RewardModelRewardConfig,
)
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

# The loading names callers import from here.
__all__ = ["BOOTSTRAP_MODEL_PREFIX", "IMPORT_PREFIX", "SELECTING_KEYS", "BootstrapConfig", "ConfigError",
           "MasterConfig", "Provenance", "UserImports", "apply_overrides", "format_validation_error",
           "import_user_modules", "load_config", "load_yaml_with_defaults", "load_yaml_with_provenance",
           "parse_cli", "schema_field", "validate_config", "with_imports"]


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
    # On-policy distillation: a frozen teacher scores the student's samples, on workers of its own
    # (cluster.teacher); docs/guides/distillation.md.
    teacher: TeacherConfig | None = None

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
        overridden. The critic trains every step (its warm-up too), ``critic.ppo_epochs`` passes each; the
        policy ``grpo.ppo_epochs`` passes a step."""
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
                passes = int(part.get("ppo_epochs", 1) if section == "critic" else get(g, GRPOConfig, "ppo_epochs"))
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
        if g.num_generations_per_prompt == 1 and (self.teacher is None or self.teacher.reward_weight != 0):
            raise ValueError(
                "grpo.num_generations_per_prompt=1: advantages compare the samples of a prompt's group, and a group "
                "of one has nothing to compare; use 2 or more (1 suits only distillation without rewards: a "
                "teacher section with teacher.reward_weight=0)")
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
        self._check_teacher()
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
                "critic": self.critic is not None, "reward_model": self.reward_model is not None,
                "teacher": self.teacher is not None}

    def _check_roles(self) -> None:
        """With cluster.resource_pools: each role this run has on a pool, and only those."""
        used = self.run_roles()
        needs_gpu = {"policy": "policy.backend=megatron"} if self.policy.backend == "megatron" else {}
        self.cluster.check_roles(used, needs_gpu, concurrent_generation=self.grpo.async_rollouts.enabled,
                                 collective_refit=self.policy.generation.refit_transport == "collective")

    def _check_teacher(self) -> None:
        t = self.teacher
        if t is None:
            return
        check_model_source(t.model_name, key="teacher.model_name")  # a missing folder fails before Ray starts
        if t.objective == "topk" and self.policy.backend != "hf":
            raise ValueError(f"teacher.objective=topk: the student's policy.backend={self.policy.backend!r} cannot "
                             "give the top-k tokens' log-probs to the loss; use teacher.objective=reverse_kl")
        if t.reward_weight == 0 and self.grpo.dynamic_sampling.enabled:
            raise ValueError("teacher.reward_weight=0 with grpo.dynamic_sampling.enabled: dynamic sampling drops the "
                             "groups whose rewards are all equal, which still carry the teacher's signal (and draws "
                             "more prompts for nothing); set grpo.dynamic_sampling.enabled=false")
        if t.reward_weight == 0 and t.kl_coef == 0:
            raise ValueError("teacher: kl_coef and reward_weight are both 0, so nothing trains the policy; set "
                             "teacher.kl_coef (distillation) or teacher.reward_weight (the environments' rewards)")

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
        never asks for the answer format the grader reads), for environments registered now. Datasets
        of one task_name share that task's one environment actor (the first's): they must name the same
        grader: a later one is graded by the first's grader, which its config does not name (a warning:
        a test or recipe that changes only the train set's grader still runs, as it always did)."""
        graders: dict[str, tuple[str, str, Any]] = {}
        for where, datasets in (("train", self.data.train_list), ("validation", self.data.validation_list)):
            for ds in datasets:
                mine = (ds.env_name, [r.model_dump() for r in ds.reward_fns or []])
                first = graders.setdefault(ds.task_name, (where, *mine))
                if first[1:] != mine:
                    what = "env_name" if first[1] != mine[0] else "reward_fns"
                    warnings.warn(f"data.{where} (task {ds.task_name!r}) names {what} "
                                  f"{mine[0 if what == 'env_name' else 1]!r}, but data.{first[0]} of the same task "
                                  f"{first[1 if what == 'env_name' else 2]!r}: a task's datasets share one grader, the "
                                  f"first's, so data.{where} is graded by data.{first[0]}'s. Give it the same {what}, or "
                                  "a task_name of its own", UserWarning, stacklevel=2)
        for where, datasets in (("train", self.data.train_list), ("validation", self.data.validation_list)):
            for ds in datasets:
                processor = ds.processor or ds.env_name
                if processor not in PROCESSOR_REGISTRY:
                    default = "" if ds.processor else " (a dataset's processor defaults to its env_name)"
                    raise ValueError(f"data.{where}.processor (task {ds.task_name!r}): no data processor {processor!r} "
                                     f"is registered{default}; set data.{where}.processor=math for prompt-only rows "
                                     f"graded by your environment, or register_processor({processor!r}, ...); "
                                     f"registered: {PROCESSOR_REGISTRY.names()}")
                try:
                    check = getattr(get_env_class(ds.env_name), "check_dataset", None) if ds.env_name in ENV_REGISTRY else None
                except ImportError as e:
                    raise ValueError(f"data.{where}.env_name (task {ds.task_name!r}): {e}") from None
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
# Loading (the machinery is nemo_like.config_loading's; here the language-model schema is plugged in)
# ---------------------------------------------------------------------------------------------
# Sections that take the options of what these keys select, as extra keys beside their own: a child
# (a file that inherits, or an override) that selects something else drops the parent's options.
# Unions of sections with a tag (a dataset generator's `kind`) are found in the schema itself.
SELECTING_KEYS: dict[str, tuple[str, ...]] = {
    "grpo": ("advantage_estimator",),
    "loss_fn": ("name", "policy_loss"),
    "policy.generation": ("backend",),
    "policy": ("backend",),
}


def schema_field(keys: list[str], schema: type[BaseModel] | None = None) -> Any:
    """The field of the config schema (``MasterConfig`` unless given) at ``keys``, or None."""
    return loading.schema_field(keys, schema or MasterConfig)


def _schema_has(keys: list[str], schema: type[BaseModel] | None = None) -> bool:
    return loading.schema_has(keys, schema or MasterConfig)


def apply_overrides(cfg: dict, overrides: list[str], schema: type[BaseModel] | None = None,
                    provenance: Provenance | None = None, selecting: dict[str, tuple[str, ...]] | None = None) -> dict:
    """``key=value`` overrides checked against ``schema`` (``MasterConfig`` unless given; ``selecting``:
    that schema's selecting keys, as its loader reads its files with); see
    ``nemo_like.config_loading.apply_overrides``."""
    return loading.apply_overrides(cfg, overrides, schema or MasterConfig, provenance,
                                   SELECTING_KEYS if schema is None else selecting)


def validate_config(cfg: dict, provenance: Provenance | None = None) -> MasterConfig:
    try:
        return MasterConfig.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {format_validation_error(e, provenance)}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> MasterConfig:
    """The YAML at ``path`` (with its ``defaults:``) and ``key=value`` overrides, checked; a ConfigError
    names the bad key and the file and line (or the command line) it came from."""
    raw, provenance = load_yaml_with_provenance(path, MasterConfig, SELECTING_KEYS)
    raw, rest = with_imports(raw, list(overrides or []))
    return validate_config(apply_overrides(raw, rest, provenance=provenance), provenance)


def inheritance_rules_markdown() -> str:
    """The rules of ``defaults:`` inheritance and overrides, for docs/reference/config.md (the
    sections that select are listed from the schema, so the page cannot fall behind it)."""
    selectors = loading.selectors_of(MasterConfig, SELECTING_KEYS)
    tagged = [".".join(map(str, p)) + f".{s.keys[0]}" for p, s in selectors.items() if s.keep is None]
    options = [f"{'.'.join(map(str, p))}.{k}" for p, s in selectors.items() if s.keep is not None for k in s.keys]

    def code(keys: list[str]) -> str:
        return ", ".join(f"`{k}`" for k in keys)

    return "\n".join([
        "## How configs combine", "",
        "- `defaults:` names a file or a list of files, relative to this one; they are merged in order, then the file "
        "itself over them. Mappings merge key by key; a list or a value replaces the parent's whole (a list of "
        "datasets is never merged item by item).",
        "- A *selecting key* decides what the rest of its section means. When a child (a file that inherits, or a "
        "`key=value` override) gives it another value than the parent's, the parent's keys that belonged to the "
        "old choice are dropped before the child's are merged in:",
        f"  - a section chosen by its tag is replaced whole: {code(tagged)} (a generator left without `kind` is "
        "`arithmetic`); a child that switches to `kind: reasoning_gym` keeps none of the parent's `min_value`, "
        "`ops`, `split`, ...;",
        f"  - a section that takes the options of what it selects keeps its own keys and drops the parent's "
        f"options: {code(options)} (`policy` holds no backend options, so nothing is dropped there).",
        "- On the command line the overrides of selecting keys are applied first, whatever their order: "
        "`data.train.generator.kind=reasoning_gym data.train.generator.dataset=letter_counting "
        "data.train.generator.split=train data.train.generator.num_samples=500` builds a new generator, with the "
        "keys the new kind requires given again.",
        "- Errors say where a key came from: `(set in my_run.yaml:4)` for the file loaded, `(inherited from "
        "examples/configs/grpo_math_tiny.yaml:56)` for a file it inherits, `(command line)` for an override; a key "
        "no file sets has its default, and no note. An inherited key cannot be removed, only set to another value: "
        "an error about one says what to set."])
