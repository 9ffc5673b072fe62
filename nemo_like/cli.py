"""Shared CLI plumbing: bad input exits with code 2 and one line that names the problem; a run that
cannot learn (an environment that does not start, grading that keeps failing) exits with code 1, and
one that collapsed (grpo.stop_on_collapse) with code 3, and one whose worker process died (a
policy or rollout worker: killed, out of memory) with code 4 and one line, and one that stopped making
progress (grpo.stall_watch: every process's stacks printed) with code 5 and one line; running the same
command again resumes it from its newest checkpoint."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_like.config import ConfigError, MasterConfig, load_config, parse_cli
from nemo_like.distributed.stall import StalledError
from nemo_like.distributed.worker_registry import started_worker
from nemo_like.utils.progress import quiet_library_bars

if TYPE_CHECKING:  # a language-model run does not load the gym modules
    from nemo_like.gym.config import GymMasterConfig


def run_cli(argv: list[str], default_config: str | Path, run: Callable[[Any], int | None],
            loader: Callable[[str, list[str]], Any] = load_config) -> int:
    from nemo_like.data.datasets import DataError
    from nemo_like.environments.supervision import EnvironmentFailureError, EnvironmentStartError
    from nemo_like.utils.checkpoint import CheckpointError

    quiet_library_bars()  # off a terminal: plain lines only
    try:
        path, overrides = parse_cli(argv, default_config)
        config = loader(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        code = run(config)
    except (DataError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (EnvironmentStartError, EnvironmentFailureError) as e:  # the run cannot learn: say why, once
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StalledError as e:  # the Python stacks of every process are printed above it
        print(f"error: {e}; run the same command again to resume from {_resume_point(config)}", file=sys.stderr)
        return 5
    except Exception as e:
        if (dead := dead_worker(e)) is None:
            raise
        print(f"error: stopped: {dead}; run the same command again to resume from {_resume_point(config)}",
              file=sys.stderr)
        return 4
    return int(code or 0)


def _resume_point(config: Any) -> str:
    ckpt = getattr(config, "checkpointing", None)
    return (f"the newest checkpoint in {ckpt.checkpoint_dir}" if ckpt is not None and ckpt.enabled
            else "the start: checkpointing is off")


# Worker-group name prefixes (RayWorkerGroup name_prefix) and the cluster.roles role each one is.
_ROLE_OF_PREFIX = {"policy": "policy", "rollout": "generation", "critic": "critic", "reward_model": "reward_model",
                   "teacher": "teacher"}


def dead_worker(e: BaseException) -> str | None:
    """"a <class> worker (<name>) died" when ``e`` (or an error it came from) is a Ray actor that
    died; None for any other error. A policy or rollout worker is not restarted in place: the one
    that comes back would hold other weights and optimizer state than its peers, so the run stops."""
    import ray

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, ray.exceptions.RayActorError) or re.search(r"ActorDiedError|The actor (is dead|died)", text):
            cls_m = re.search(r"class_name: (\w+)", text)
            name_m = re.search(r"\bname: ([\w.-]+)", text)
            node_m = re.search(r"its node has died\. Node Id: (\w+)", text)
            cls, name, node = (cls_m and cls_m.group(1)), (name_m and name_m.group(1)), (node_m and node_m.group(1))
            actor_id = getattr(e, "actor_id", None)
            known = started_worker(actor_id)
            if known is not None and not cls:  # an error that carries only the actor id (ActorUnavailableError)
                cls, name = known.class_name, name or known.name
            if known is not None and not node and known.node_id:
                node = _lost_node(actor_id, known.node_id)
            who = (f"a {cls}" + ("" if cls.endswith("Worker") else " actor")) if cls else "a worker process"
            # A worker group names its actors <prefix>-<rank>-<group id>; the prefix says the role.
            role = _ROLE_OF_PREFIX.get(name.split("-")[0]) if name else None
            return (who + (f" ({name}" + (f", the {role} role" if role else "") + ")" if name else "")
                    + (f" died with its node {node[:8]}" if node else " died"))
        e = e.__cause__ or e.__context__
    return None


def _lost_node(actor_id: str, node_id: str, wait_s: float = 45.0) -> str | None:
    """``node_id`` when the actor died with its node, else None. The owner often hears of the death
    before Ray's control store does: a killed raylet takes its workers down at once, but the node is
    declared dead only after missed health checks (about 15 s). So wait until the store has a verdict:
    the actor DEAD on a live node (a crash or a kill: within a second) or the node dead."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while True:
        if not _node_alive(node_id):
            return node_id
        try:
            state = ray._private.state.actors(actor_id=actor_id) or {}
        except Exception:  # noqa: BLE001 - no verdict to be had: say nothing about the node
            return None
        if not state:  # an actor the store never knew (it keeps the dead ones): no verdict will come
            return None
        if state.get("State") == "DEAD":
            m = re.search(r"node has died\. Node Id: (\w+)", str(state.get("DeathCause", "")))
            return m.group(1) if m else (None if _node_alive(node_id) else node_id)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)


def _node_alive(node_id: str) -> bool:
    import ray

    try:
        return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())
    except Exception:  # noqa: BLE001 - Ray gone too: say nothing about the node
        return True


def run_grpo(config: MasterConfig) -> int:
    """The GRPO CLI: a thin loop over `GRPOExperiment` (the object a notebook drives), then a
    before/after accuracy summary (per task in multi-task runs) and the curves as a PNG. A run that
    collapsed (grpo.stop_on_collapse) ends early with one line and exit code 3."""
    import time

    from nemo_like.algorithms.grpo import accuracy_summary, per_task_summary
    from nemo_like.experiment import GRPOExperiment

    t0 = time.perf_counter()
    with GRPOExperiment(config) as exp:
        exp.train()
        png = exp.save_plot()
        print(f"[nemo_like] {accuracy_summary(exp.trainer)}")
        for line in per_task_summary(exp.trainer):
            print(f"[nemo_like]   {line}")
        print(f"[nemo_like] {exp.step_count} steps, wall time {time.perf_counter() - t0:.0f} s; "
              f"metrics: {Path(config.logger.log_dir) / 'metrics.jsonl'}; curves: {png}")
        if exp.stop_reason:
            where = f"; checkpoint in {config.checkpointing.checkpoint_dir}" if config.checkpointing.enabled else ""
            print(f"error: stopped: {exp.stop_reason}{where}", file=sys.stderr)
            return 3
    return 0


def run_grpo_gym(config: GymMasterConfig) -> int:
    """The gym GRPO CLI: train until grpo.max_num_steps or grpo.target_val_return, then a summary of
    the greedy held-out return before and after, and the curves as a PNG. A run that cannot learn
    (no complete group for grpo.max_empty_steps updates) exits with code 1, saying why."""
    import time

    from nemo_like.gym.experiment import GymGRPOExperiment

    t0 = time.perf_counter()
    with GymGRPOExperiment(config) as exp:
        exp.train()
        png = exp.save_plot()
        tr = exp.trainer
        val = exp.returns()
        target = config.grpo.target_val_return
        first = f"{tr.first_val_return:.1f}" if tr.first_val_return is not None else "n/a"
        last = f"{val[-1]:.1f}" if len(val) else "n/a"
        reached = "" if target is None else (f"; target {target:g} reached" if tr.reached_target
                                             else f"; target {target:g} NOT reached")
        print(f"[nemo_like] {config.env.id}: greedy val/return_mean {first} -> {last} over "
              f"{config.grpo.val_episodes} held-out seeds{reached}")
        print(f"[nemo_like] {exp.step_count} updates, {tr.env_steps} environment steps, wall time "
              f"{time.perf_counter() - t0:.0f} s; metrics: {Path(config.logger.log_dir) / 'metrics.jsonl'}; curves: {png}")
        if exp.stop_reason:
            print(f"error: stopped: {exp.stop_reason}", file=sys.stderr)
            return 1
    return 0
