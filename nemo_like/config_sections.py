"""The sections of the language-model config (``grpo``, ``cluster``, ``bootstrap``, ``data``), apart
from ``MasterConfig`` in ``nemo_like.config``, which re-exports them. The ``policy``,
``loss_fn``, ``critic``, ``logger`` and ``checkpointing`` sections live beside the code they configure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.data.datasets import DatasetConfig
from nemo_like.utils.options import apply_registered_options

__all__ = ["AsyncRolloutsConfig", "BootstrapConfig", "ClusterConfig", "CollapseStopConfig", "DataConfig",
           "DynamicSamplingConfig", "GAEConfig", "GRPOConfig", "GenerationClusterConfig", "KLInRewardConfig",
           "ModelBuildConfig", "ROLES", "ResourcePoolConfig", "SFTBootstrapConfig", "StallWatchConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DynamicSamplingConfig(_Strict):
    """DAPO dynamic sampling: groups whose rewards are all equal are dropped and more prompts drawn."""

    # Drop groups whose rewards are all equal (no gradient) and draw more prompts to fill the step.
    enabled: bool = False
    # Generation rounds (of grpo.num_prompts_per_step prompts each) at most per step; then the step
    # trains on the groups it has (the rest of the batch carries no loss; see dynamic_sampling/*).
    max_gen_batches: int = Field(4, ge=1)


class KLInRewardConfig(_Strict):
    """The KL to the reference policy as a per-token penalty in the reward (RLHF-style PPO), beside or
    instead of the loss-side ``loss_fn.reference_policy_kl_penalty``. ``adaptive``: the coefficient
    follows the proportional rule towards ``target_kl`` over ``horizon`` samples, updated after the
    batch that measured it."""

    # Subtract coef x the per-token KL (old policy vs reference) from the rewards; loads the reference model.
    enabled: bool = False
    # "fixed": the coefficient stays init_coef. "adaptive": it is steered towards target_kl after each batch.
    controller: Literal["fixed", "adaptive"] = "fixed"
    # The KL coefficient (the starting one with the adaptive controller).
    init_coef: float = Field(0.001, ge=0)
    # Adaptive only: the KL aimed at, per response token (averaged over each sample's tokens, then samples).
    target_kl: float = Field(0.1, gt=0)
    # Adaptive only: samples over which the coefficient moves; after a batch of n samples it is multiplied
    # by 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon.
    horizon: int = Field(10000, gt=0)
    # Per-token KL estimate from d = old log-prob - reference log-prob: k1 = d, k2 = d^2 / 2,
    # k3 = exp(-d) - 1 + d, abs = |d|.
    estimator: Literal["k1", "k2", "k3", "abs"] = "k1"


class GAEConfig(_Strict):
    """Generalised advantage estimation (``grpo.advantage_estimator: gae``, with a ``critic``)."""

    # Discount per response token (1.0: none, the usual choice for a reward at the end of the response).
    gamma: float = Field(1.0, ge=0, le=1)
    # GAE's lambda: 1 gives Monte-Carlo returns minus the values, 0 one-step TD errors (less variance, more bias).
    lam: float = Field(0.95, ge=0, le=1)
    # Normalise the advantages to mean 0 and std 1 over the batch's response tokens.
    whiten_advantages: bool = True


class CollapseStopConfig(_Strict):
    """Stop a run that has collapsed (see nemo_like.algorithms.guards.CollapseWatch)."""

    # Watch the step metrics for the collapse signatures below and stop the run (with a checkpoint) on one.
    enabled: bool = True
    patience: int = Field(5, ge=1)  # consecutive steps a signature must last
    truncation_rate: float = Field(0.9, ge=0, le=1)  # generation collapse: at least this truncated...
    reward_floor: float = 0.0  # ...and mean reward at most this
    zero_std_group_frac: float = Field(0.99, gt=0, le=1)  # advantage collapse: this share of groups flat
    # Reward hacking (runs with a reward model): the environments' own reward (rm/env_reward_mean, the
    # verifier's verdict) at most this share of its best so far, while the reward model's score
    # (rm/score_mean) is above what it was at that best. None: not watched.
    gold_drop: float | None = Field(0.5, gt=0, lt=1)


class StallWatchConfig(_Strict):
    """A run that stops making progress prints every process's stacks and stops with one line naming
    what it waited for (nemo_like/distributed/stall.py)."""

    # A step (its checkpoint save included) or a validation running past this multiple of the median
    # of those before it is a stall, unless what it waits for has a time limit of its own still ahead
    # (an environment call's step_timeout_s). null: only first_s applies.
    factor: float | None = Field(20.0, gt=1)
    # ...and past at least this many seconds (a 1-second step's 20x would trip on a busy machine).
    min_s: float = Field(300.0, gt=0)
    # Phases of a kind timed before their median counts (the first steps compile, warm caches).
    after: int = Field(3, ge=1)
    # The limit of a kind's first `after` phases (the first step: loading, compiling). null: unwatched.
    first_s: float | None = Field(None, gt=0)


class AsyncRolloutsConfig(_Strict):
    """Asynchronous GRPO: rollout workers generate and grade the next steps' groups while the trainer
    trains (needs policy.generation.colocated: false)."""

    # Generate ahead on the rollout group while the trainer trains (also needs
    # loss_fn.use_importance_sampling_correction; not with dynamic_sampling).
    enabled: bool = False
    # How many optimizer steps older than the trained weights a sample's generating weights may be.
    # 0 is the synchronous loop's guarantee (generation still overlaps grading and validation).
    max_staleness: int = Field(1, ge=0)
    # "wait": a batch is not started until its samples are sure to be within the bound. "drop":
    # generation never waits; a sample past the bound when its step comes is dropped and counted.
    on_stale: Literal["wait", "drop"] = "wait"
    # Finished steps' batches that may wait for the trainer (bounds memory and, with "drop", waste).
    buffer_size: int = Field(2, ge=1)


class GRPOConfig(BaseModel):
    # "allow": the selected estimator's own options (register_advantage_estimator(..., options=Model)),
    # checked by _estimator_options against that model.
    model_config = ConfigDict(extra="allow")

    # Prompts drawn from the train data per GRPO step.
    num_prompts_per_step: int = Field(16, gt=0)
    # Completions sampled per prompt (G, one group): advantages compare the samples of a group. 1 only
    # for distillation without rewards (teacher.reward_weight=0): the teacher's signal needs no group.
    num_generations_per_prompt: int = Field(8, ge=1)
    # GRPO steps to train (a resumed run continues up to it); 0: validation only. A step's
    # num_prompts_per_step x num_generations_per_prompt samples make one or more optimizer steps.
    max_num_steps: int = Field(100, ge=0)
    # Passes over the training data at most: no step starts once this many full passes were trained
    # (whichever of max_num_steps, max_num_epochs and max_duration_s comes first ends the run).
    max_num_epochs: int = Field(1000, gt=0)
    # Wall-clock budget of the training loop in seconds (validation at start included): no step
    # starts after it is spent, and the end's validation still runs. null: steps alone decide.
    max_duration_s: float | None = Field(None, gt=0)
    # Assistant turns per episode at most (1: single-turn); an episode also ends when its environment
    # ends it or when it reaches policy.max_total_sequence_length.
    max_rollout_turns: int = Field(1, gt=0)
    # advantage_estimator "grpo" only: the baseline is the mean of the group's other samples (RLOO)
    # rather than the group mean, which includes the sample itself.
    use_leave_one_out_baseline: bool = True
    # advantage_estimator "grpo" only: divide the advantages by the std of the group's rewards ("group"),
    # of the whole batch's ("batch"), or not at all (null).
    std_scale: Literal["group", "batch"] | None = "group"
    # A registered advantage estimator: grpo, dr_grpo (= mean), mean_std, rloo, reinforce_pp, gae (needs
    # a critic section), remax, or one of yours (register_advantage_estimator).
    advantage_estimator: str = "grpo"
    # Passes over each step's batch (TRL's num_iterations, verl's ppo_epochs, the GRPO paper's mu): every
    # pass clips the ratio against the log-probs from before the step's first update, so the later passes
    # are off-policy by the earlier ones' updates. Each pass's metrics are logged (train/pass<k>/...).
    ppo_epochs: int = Field(1, ge=1)
    # A sample counts as solved, for train/ and val/ accuracy, when its reward is at least this. 1.0 suits
    # the built-in graders (1 = right); set it for rewards on another scale (e.g. 0.5 for a [0, 1) score).
    success_threshold: float = 1.0
    val_period: int = Field(10, ge=0)  # 0: validate only at start and end
    # Validate the base model before the first step (not when a run resumes past step 0).
    val_at_start: bool = True
    # Validate after the last step, unless that step was just validated (val_period).
    val_at_end: bool = True
    # Validation prompts at most, greedy, one sample each: the first ones of the data (of each task in a
    # multi-task run).
    max_val_samples: int = Field(256, gt=0)
    # Truncated samples (cut off by a length limit) stay in their group's baseline but carry no loss:
    # rewarding a right answer followed by a runaway tail teaches the model never to stop (DAPO).
    overlong_filtering: bool = False
    # Use the sampler's log-probs as the old policy's instead of recomputing them ("auto": at float32, when
    # the sampler is the training model or a backend with the trainer_logprobs capability: the same numbers).
    reuse_generation_logprobs: bool | Literal["auto"] = "auto"
    # While reusing, recompute every this many steps (0: never) so the mismatch stays measured.
    logprob_check_period: int = Field(10, ge=0)
    # Leave out of the training pass the samples that cannot move the weights: those with no loss
    # (sample mask 0) and, when the loss gives a zero advantage no gradient (no KL penalty), those
    # whose advantage is 0 (every group whose rewards are all equal). The update is the same (the
    # loss's normalisers still count them); the loss's train/ metrics are then over the samples trained.
    skip_inert_samples: bool = True
    # A task whose every sample could not be graded (the environment raised, timed out or died) this
    # many steps in a row stops the run: it would train on nothing. 0: never stop.
    max_consecutive_env_failures: int = Field(3, ge=0)
    # Time limit of one environment step call, unless env.<name>.step_timeout_s sets its own.
    env_step_timeout_s: float = Field(600.0, gt=0)
    # Turn by turn, tasks whose environment calls took at least this many seconds (moving average)
    # are generated first, and their calls run while the other tasks generate (a tool waiting on a
    # web API, a slow sandbox). null: every turn is one generate call, then all calls.
    slow_env_first_s: float | None = Field(0.5, gt=0)
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    stop_on_collapse: CollapseStopConfig = CollapseStopConfig()
    stall_watch: StallWatchConfig = StallWatchConfig()
    async_rollouts: AsyncRolloutsConfig = AsyncRolloutsConfig()
    kl_in_reward: KLInRewardConfig = KLInRewardConfig()
    gae: GAEConfig = GAEConfig()
    # Seeds Python, NumPy and torch, the prompt sampler's order and the workers (policy, critic, rollout).
    seed: int = 42

    @model_validator(mode="after")
    def _estimator_options(self) -> GRPOConfig:
        apply_registered_options(self, "grpo", [(ADVANTAGE_ESTIMATORS, self.advantage_estimator)])
        return self


class GenerationClusterConfig(_Strict):
    """The rollout worker group of ``policy.generation.colocated: false`` (data parallel: each worker
    holds a whole copy of the model and generates its share of a batch)."""

    # Workers (Ray actors) in this group.
    num_workers: int = Field(1, gt=0)
    # Ray CPUs reserved per worker; its torch and OpenMP threads are set to this (at least 1) unless
    # policy.num_threads (critic.num_threads for the critic's group) sets them.
    cpus_per_worker: float = Field(1.0, gt=0)
    # Ray GPUs per worker (fractions share a GPU); > 0 puts the worker's model on its GPU, 0 on the CPU.
    gpus_per_worker: float = Field(0.0, ge=0)


class ResourcePoolConfig(_Strict):
    """Machines set aside for the roles named to this pool in ``cluster.roles``: ``nodes`` distinct Ray
    nodes, each giving the pool ``cpus_per_node`` CPUs and ``gpus_per_node`` GPUs."""

    # Distinct Ray nodes the pool spans (its bundles are spread one node each).
    nodes: int = Field(1, gt=0)
    # CPUs the pool takes on each of its nodes; a role's workers on a node split them.
    cpus_per_node: float = Field(1.0, gt=0)
    # GPUs the pool takes on each node (whole GPUs): each worker of a role gets one of them.
    gpus_per_node: int = Field(0, ge=0)
    # A custom Ray resource the pool's nodes must have (a node started with --resources='{"rm": 1}'):
    # puts the pool on those named nodes; None: any node with room.
    node_resource: str | None = None


# The roles a run places; the reference model runs inside the policy's workers, so its pool is the policy's.
ROLES = ("policy", "generation", "reference", "critic", "reward_model", "teacher")
# The section of ClusterConfig that sizes each role's worker group (num_workers) when it is on a pool.
ROLE_SECTIONS = {"policy": "cluster", "generation": "cluster.generation", "critic": "cluster.critic",
                 "reward_model": "cluster.reward_model", "teacher": "cluster.teacher"}


class ClusterConfig(_Strict):
    # The policy's training workers (data parallel ranks); policy.train_global_batch_size must divide by it.
    num_workers: int = Field(1, gt=0)
    # Ray CPUs reserved per training worker; its torch and OpenMP threads are set to this (at least 1)
    # unless policy.num_threads says otherwise.
    cpus_per_worker: float = Field(1.0, gt=0)
    # Ray GPUs per training worker; > 0 trains on the GPU, 0 on the CPU.
    gpus_per_worker: float = Field(0.0, ge=0)
    # Local cluster size when we start Ray ourselves; None lets Ray count the machine's CPUs.
    num_cpus: int | None = None
    # Address of a Ray cluster to join; None: $RAY_ADDRESS, else a new local cluster.
    address: str | None = None
    generation: GenerationClusterConfig = GenerationClusterConfig()
    # The critic's worker group (a `critic` section): data parallel over num_workers, like the policy's.
    critic: GenerationClusterConfig = GenerationClusterConfig()
    # The reward model's worker group (a `reward_model` section).
    reward_model: GenerationClusterConfig = GenerationClusterConfig()
    # The distillation teacher's worker group (a `teacher` section): each worker scores its share of a batch.
    teacher: GenerationClusterConfig = GenerationClusterConfig()
    # Named pools of machines ({name: {nodes, cpus_per_node, gpus_per_node, node_resource}}); empty:
    # each role gets a placement group of its own, sized by its section above (num_workers x cpus_per_worker).
    resource_pools: dict[str, ResourcePoolConfig] = {}
    # Which pool each role runs on ({policy, generation, reference, critic, reward_model, teacher}: pool name).
    # Roles in one pool share its CPUs/GPUs, time-sliced; roles in different pools never compete. On a
    # pool a role's size is its section's num_workers (a multiple of the pool's nodes); the pool sets
    # the CPUs and GPUs of each worker.
    roles: dict[str, str] = {}

    @model_validator(mode="after")
    def _pools_and_roles(self) -> ClusterConfig:
        if not self.resource_pools:
            if self.roles:
                raise ValueError(f"cluster.roles names pools ({sorted(set(self.roles.values()))}) but "
                                 "cluster.resource_pools is empty: define them, e.g. cluster.resource_pools."
                                 f"{next(iter(self.roles.values()))}={{nodes: 1, cpus_per_node: 2}}")
            return self
        for role, pool in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"cluster.roles.{role}: no such role; roles: {list(ROLES)}")
            if pool not in self.resource_pools:
                raise ValueError(f"cluster.roles.{role}: no pool {pool!r} in cluster.resource_pools; "
                                 f"pools: {sorted(self.resource_pools)}")
        for name in self.resource_pools:
            if name not in self.roles.values():
                raise ValueError(f"cluster.resource_pools.{name}: no role runs on it; name it in cluster.roles "
                                 "or remove it")
        return self

    def role_workers(self, role: str) -> GenerationClusterConfig | ClusterConfig:
        """The section that sizes ``role``'s worker group (num_workers, and without pools its CPUs/GPUs)."""
        return self if role in ("policy", "reference") else getattr(self, role)

    def check_roles(self, used: dict[str, bool], needs_gpu: dict[str, str], *, concurrent_generation: bool = False,
                    collective_refit: bool = False) -> None:
        """With pools: every role the run has (``used``) on one, none it lacks, the reference model on
        the policy's pool, worker counts that spread evenly over a pool's nodes, GPUs where a role needs
        them (``needs_gpu``: role -> why), and no sharing that cannot work: rollout workers that generate
        while the policy trains (``concurrent_generation``, async GRPO) or that join the policy in an NCCL
        group (``collective_refit``) on the policy's GPUs. Raises ValueError naming the key."""
        if not self.resource_pools:
            return
        needs_gpu = dict(needs_gpu)
        for role, on in used.items():
            if on and role not in self.roles and role != "reference":
                raise ValueError(f"cluster.roles.{role}: this run has a {role} role but no pool for it; "
                                 f"name one of {sorted(self.resource_pools)}")
            if not on and role in self.roles:
                raise ValueError(f"cluster.roles.{role}: this run has no {role} role ({_ROLE_WHEN[role]}); "
                                 "remove the key")
        ref = self.roles.get("reference")
        if ref is not None and ref != self.roles.get("policy"):
            raise ValueError(f"cluster.roles.reference={ref!r}: the reference model runs inside the policy's "
                             f"workers, so it is on the policy's pool ({self.roles.get('policy')!r}); remove the key "
                             "or name that pool")
        for role, pool_name in self.roles.items():
            if role == "reference":
                continue
            pool, section = self.resource_pools[pool_name], self.role_workers(role)
            key = ROLE_SECTIONS[role]
            if "gpus_per_worker" in section.model_fields_set and section.gpus_per_worker > 0:
                needs_gpu.setdefault(role, f"{key}.gpus_per_worker={section.gpus_per_worker:g}")
            if role in needs_gpu and not pool.gpus_per_node:
                raise ValueError(f"cluster.roles.{role}={pool_name!r}: {needs_gpu[role]} asks for a GPU, and the "
                                 f"pool has none; set cluster.resource_pools.{pool_name}.gpus_per_node or put {role} "
                                 "on a GPU pool")
            n = section.num_workers
            if pool.gpus_per_node and n != pool.nodes * pool.gpus_per_node:
                raise ValueError(f"{key}.num_workers={n}: pool {pool_name!r} has {pool.nodes} node(s) x "
                                 f"{pool.gpus_per_node} GPU(s) and each worker takes one GPU; set {key}.num_workers="
                                 f"{pool.nodes * pool.gpus_per_node}")
            if n % pool.nodes:
                raise ValueError(f"{key}.num_workers={n} does not spread evenly over pool {pool_name!r}'s "
                                 f"{pool.nodes} nodes; use a multiple of {pool.nodes}")
            # The pool sizes each worker; a section that says otherwise would be silently overruled. The
            # key may be inherited from a file the user did not write: the fix is a value to set, not a
            # key to remove (an inherited key cannot be removed, only set).
            per_node = pool.gpus_per_node or n // pool.nodes
            share = pool.cpus_per_node / per_node
            if "cpus_per_worker" in section.model_fields_set and abs(section.cpus_per_worker - share) > 1e-9:
                raise ValueError(f"{key}.cpus_per_worker={section.cpus_per_worker:g}: on pool {pool_name!r} each "
                                 f"{role} worker gets {share:g} CPU(s) (cpus_per_node / workers a node); set "
                                 f"{key}.cpus_per_worker={share:g} (or leave it out), or set cluster.resource_pools."
                                 f"{pool_name}.cpus_per_node={section.cpus_per_worker * per_node:g} to give each "
                                 f"worker {section.cpus_per_worker:g}")
            gpus = 1 if pool.gpus_per_node else 0
            if "gpus_per_worker" in section.model_fields_set and section.gpus_per_worker != gpus:
                raise ValueError(f"{key}.gpus_per_worker={section.gpus_per_worker:g}: on pool {pool_name!r} each "
                                 f"{role} worker gets {gpus} GPU; set {key}.gpus_per_worker={gpus} (or leave it out)"
                                 + ("" if gpus else f", or give the pool GPUs (cluster.resource_pools.{pool_name}."
                                                    "gpus_per_node)"))

        gen, pol = self.roles.get("generation"), self.roles.get("policy")
        if gen is not None and gen == pol:  # (a run without generation has no cluster.roles.generation: above)
            if concurrent_generation:  # time-slicing needs one phase at a time
                raise ValueError(f"cluster.roles.generation={gen!r}: with grpo.async_rollouts the rollout workers "
                                 "generate while the policy trains, so they cannot share the policy's pool; put "
                                 "generation on a pool of its own")
            if collective_refit and self.resource_pools[gen].gpus_per_node:
                raise ValueError(f"policy.generation.refit_transport=collective: the policy and the rollout workers "
                                 f"share the GPUs of pool {gen!r}, and NCCL will not join two ranks on one GPU; use "
                                 "refit_transport=object_store or put generation on a pool of its own")

    def pool_sharing(self) -> dict[str, list[str]]:
        """Pool name -> the roles on it that have workers of their own (the reference model has none)."""
        out: dict[str, list[str]] = {}
        for role, pool in self.roles.items():
            if role != "reference":
                out.setdefault(pool, []).append(role)
        return out


_ROLE_WHEN = {"policy": "always present", "generation": "only with policy.generation.colocated=false",
              "reference": "only with a KL penalty", "critic": "only with a critic section",
              "reward_model": "only with a reward_model section", "teacher": "only with a teacher section"}


class RewardModelRewardConfig(_Strict):
    """A trained reward model (examples/run_rm.py's output, or any one-label sequence-classification
    folder) whose score is added to the environments' rewards of every training sample."""

    # HF hub id or folder of the reward model; it may use another tokenizer and chat template than the
    # policy: each conversation is rendered again with its own.
    model_name: str
    # Let transformers run the model's own code from its folder (only for a reward model you trust).
    trust_remote_code: bool = False
    # The sample's reward is env_weight x env reward + weight x score (per task: task_weights[task]).
    weight: float = 1.0
    # 0 trains on the reward model alone; the environments' reward is still logged (rm/env_reward_mean):
    # the gold score beside the proxy, to watch over-optimisation.
    env_weight: float = 1.0
    # Per task_name weights, instead of weight for the tasks named.
    task_weights: dict[str, float] = {}
    # Tokens of a rendered conversation the reward model reads; a longer one keeps its last ones.
    max_length: int = Field(512, gt=1)
    # Conversations per forward pass on a worker.
    forward_micro_batch_size: int = Field(64, gt=0)


class ModelBuildConfig(_Strict):
    # Width of the tiny Llama (must divide by num_heads).
    hidden_size: int = 128
    # Decoder layers.
    num_layers: int = 4
    # Attention heads per layer.
    num_heads: int = 4
    # Width of the MLP; None: 4 x hidden_size.
    intermediate_size: int | None = None
    # Positions the model is built for (LlamaConfig.max_position_embeddings), in tokens.
    max_position_embeddings: int = 256
    # Strings that become single (non-special) tokens, as Qwen's "<tool_call>" is: shorter tool turns.
    extra_tokens: list[str] = []


class SFTBootstrapConfig(_Strict):
    # Optimizer steps of the supervised run (0: the randomly initialised model is used as it is).
    num_steps: int = Field(60, ge=0)
    # Examples per optimizer step, over all workers.
    batch_size: int = Field(64, gt=0)
    # Examples per forward/backward pass on a worker (capped at batch_size).
    micro_batch_size: int = Field(64, gt=0)
    # Peak learning rate; it replaces policy.optimizer.lr for this run (AdamW's other settings are policy's).
    lr: float = Field(3e-3, gt=0)
    # Optimizer steps of linear warmup to lr.
    warmup_steps: int = 5
    # "cosine": decay to 0 over num_steps. (Measured once: 1600 cosine steps left the multi-env base far
    # weaker than 2400 constant ones, math 17% against 67%; fewer steps do not make up for the decay.)
    lr_decay: Literal["constant", "cosine"] = "constant"
    # Batches of similar length (HF Trainer's group_by_length): mixed tasks then pad far less.
    group_by_length: bool = False
    # Stop once the held-out loss (per-token NLL of the assistant's tokens of holdout_rows rows kept out
    # of training, checked every val_every steps) is at or below this; num_steps is then the most it
    # runs. None: num_steps steps. A base meant to leave RL room to learn sits on the steep part of its
    # curve, where the step that reaches it moves with rounding; a held-out loss is a steadier mark.
    stop_at_val_loss: float | None = Field(None, gt=0)
    # Rows of the supervised data kept out of training for that loss (only with stop_at_val_loss).
    holdout_rows: int = Field(256, gt=0)
    # Optimizer steps between two checks of the held-out loss (and one after the last step).
    val_every: int = Field(25, gt=0)


class BootstrapConfig(_Strict):
    """Builds the embedded default base model: a tiny char-level Llama taught the answer format by a
    short supervised run. Cached under cache_dir keyed by this section, so it is built once."""

    # Build (or take from the cache) the tiny model and train it as policy.model_name; turned off, with
    # a printed line, when policy.model_name names a model of yours.
    enabled: bool = True
    # Where built models are kept (a folder per config); default $NEMO_LIKE_CACHE, else ~/.cache/nemo_like.
    cache_dir: str = Field(default_factory=lambda: os.environ.get(
        "NEMO_LIKE_CACHE", str(Path.home() / ".cache" / "nemo_like")))
    # Seed of the model's initial weights and of the supervised run.
    seed: int = 0
    model: ModelBuildConfig = ModelBuildConfig()
    sft: SFTBootstrapConfig = SFTBootstrapConfig()
    # The supervised run's data (problems and their answers); None: the datasets of data.train.
    data: DatasetConfig | None = None
    # Training workers of the bootstrap SFT (None: cluster.num_workers); the cluster's CPUs are split
    # among them. One worker with every thread beats two FSDP ranks on a ~1M-parameter model.
    num_workers: int | None = Field(None, gt=0)


class DataConfig(_Strict):
    # Longest prompt in tokens (chat template included); a longer one is cut and carries no loss.
    max_input_seq_length: int = Field(64, gt=0)
    # A prompt longer than max_input_seq_length is cut and carries no loss; a run where more than this
    # share of the prompts would be cut is refused before Ray starts (the rest are counted per step).
    max_cut_prompt_frac: float = Field(0.02, ge=0, le=1)
    # One dataset, or a list of them for a multi-task run (each routed to its task's environment).
    train: DatasetConfig | list[DatasetConfig]
    # Held-out dataset(s) of the greedy validation (grpo.val_period); None: no validation.
    validation: DatasetConfig | list[DatasetConfig] | None = None

    @property
    def train_list(self) -> list[DatasetConfig]:
        return self.train if isinstance(self.train, list) else [self.train]

    @property
    def validation_list(self) -> list[DatasetConfig]:
        v = self.validation
        return [] if v is None else v if isinstance(v, list) else [v]
