"""The pure parts of benchmarks/compare_estimators.py: reading metrics.jsonl back, the marks and the table."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_estimators.py"
_spec = importlib.util.spec_from_file_location("compare_estimators", _PATH)
ce = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("compare_estimators", ce)
_spec.loader.exec_module(ce)


def _rows(step_s: list[float], val_every: int, accs: list[float], vf: list[float] | None = None) -> list[dict]:
    """metrics.jsonl rows as the trainer writes them: step 0's validation, one row per step (with the
    periodic validation in it), and the end's validation as a row of its own."""
    it = iter(accs)
    rows = [{"step": 0, "val/accuracy": next(it), "timing/validation": 1.0}]
    for i, s in enumerate(step_s, start=1):
        r = {"step": i, "timing/total": s, "train/num_samples": 128.0, "train/reward_mean": 0.5}
        if vf:
            r["critic/vf_explained_var"] = vf[i - 1]
        if val_every and i % val_every == 0:
            r["val/accuracy"] = next(it)
        rows.append(r)
    if not (val_every and len(step_s) % val_every == 0):
        rows.append({"step": len(step_s), "val/accuracy": next(it)})
    return rows


def test_read_metrics_skips_a_cut_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 0, "val/accuracy": 0.5}) + "\n" + '{"step": 1, "timing/to')
    assert ce.read_metrics(p) == [{"step": 0, "val/accuracy": 0.5}]
    assert ce.read_metrics(tmp_path / "absent.jsonl") == []


def test_build_curve_times_and_samples_at_each_validation():
    c = ce.build_curve(_rows([3.0, 1.0, 1.0, 2.0, 1.0], 2, [0.5, 0.6, 0.7, 0.8], vf=[0.1, 0.2, 0.3, 0.4, 0.5]))
    assert c["steps"] == [1, 2, 3, 4, 5]
    assert c["train_s"] == [3.0, 4.0, 5.0, 7.0, 8.0]
    assert c["cum_samples"][-1] == 640.0
    assert [(p["step"], p["train_s"], p["samples"], p["accuracy"]) for p in c["val"]] == [
        (0, 0.0, 0.0, 0.5), (2, 4.0, 256.0, 0.6), (4, 7.0, 512.0, 0.7), (5, 8.0, 640.0, 0.8)]
    assert c["last_vf_explained_var"] == 0.5


def test_build_curve_a_second_validation_at_one_step_replaces_the_first():
    rows = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "timing/total": 1.0, "train/num_samples": 4.0,
                                               "val/accuracy": 0.6}, {"step": 1, "val/accuracy": 0.7}]
    assert [p["accuracy"] for p in ce.build_curve(rows)["val"]] == [0.5, 0.7]


def test_nearest_prefers_the_earlier_on_a_tie():
    pts = [{"t": 0.0}, {"t": 10.0}, {"t": 20.0}]
    assert ce.nearest(pts, "t", 14.0) == {"t": 10.0}
    assert ce.nearest(pts, "t", 15.0) == {"t": 10.0}
    assert ce.nearest(pts, "t", 16.0) == {"t": 20.0}
    assert ce.nearest([], "t", 1.0) is None


def test_summarize_marks_are_the_shortest_run_and_the_fewest_steps():
    curves = {
        # fast: 6 steps in 6 s, validated every 2 steps
        "fast": ce.build_curve(_rows([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2, [0.5, 0.6, 0.7, 0.8])),
        # slow: 3 steps in 9 s (stopped by its time budget), validated at step 2 and at the end
        "slow": ce.build_curve(_rows([3.0, 3.0, 3.0], 2, [0.5, 0.55, 0.65])),
        "crashed": ce.build_curve([{"step": 0, "val/accuracy": 0.5}]),
    }
    s = ce.summarize(curves)
    assert s["time_mark_s"] == 7.0 and s["step_mark"] == 3  # fast's total training time; slow's steps
    fast, slow, crashed = (s["variants"][k] for k in ("fast", "slow", "crashed"))
    assert fast["acc_at_time"] == 0.8 and fast["acc_at_time_s"] == 7.0  # its last point (step 6, 7 s)
    assert slow["acc_at_time"] == 0.55 and slow["acc_at_time_s"] == 6.0  # step 2 at 6 s, not step 3 at 9 s
    assert fast["acc_at_step"] == 0.6 and fast["acc_at_step_step"] == 2  # steps 2 and 4 tie: the earlier
    assert slow["acc_at_step"] == 0.65 and slow["acc_at_step_step"] == 3
    assert fast["s_per_step_mean"] == pytest.approx(1.0) and fast["first_step_s"] == 2.0
    assert (fast["acc_start"], fast["acc_end"], fast["steps_done"]) == (0.5, 0.8, 6)
    assert crashed["steps_done"] == 0 and crashed["acc_end"] is None and crashed["acc_at_time"] is None
    assert crashed["acc_start"] == 0.5 and crashed["s_per_step_mean"] is None


def test_format_table_one_row_per_variant_and_notes_off_mark_points():
    curves = {"grpo": ce.build_curve(_rows([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2, [0.5, 0.6, 0.7, 0.8])),
              "gae": ce.build_curve(_rows([3.0, 3.0, 3.0], 2, [0.5, 0.55, 0.65], vf=[-0.5, 0.1, 0.25]))}
    text = ce.format_table(ce.summarize(curves), {"grpo": "GRPO", "gae": "PPO-GAE"},
                           {"grpo": "steps", "gae": "seconds"})
    lines = text.splitlines()
    assert len(lines) == 4 and "acc @ 7 s" in lines[0] and "acc @ step 3" in lines[0]
    grpo, gae = lines[2], lines[3]
    assert grpo.startswith("GRPO") and "80.0%" in grpo and "60.0% (step 2)" in grpo and grpo.rstrip().endswith("-")
    assert gae.startswith("PPO-GAE") and "55.0% (6 s)" in gae and "seconds" in gae and gae.endswith("0.250")


def test_variant_overrides_route_critic_settings_to_ppo_only(tmp_path):
    user = ["critic.warmup_steps=1", "policy.optimizer.lr=1e-4", "cluster.critic.cpus_per_worker=1"]
    kw = dict(steps=10, seconds=60.0, val_samples=50, val_period=5, prompts=32, generations=4, work=tmp_path, user=user)
    grpo, gae = ce.variant_overrides("rloo", **kw), ce.variant_overrides("gae", **kw)
    assert "grpo.advantage_estimator=rloo" in grpo and "policy.optimizer.lr=1e-4" in grpo
    assert not any(o.startswith(("critic.", "cluster.critic.")) for o in grpo)
    assert "critic.warmup_steps=1" in gae and "cluster.critic.cpus_per_worker=1" in gae
    for ov in (grpo, gae):
        assert "grpo.dynamic_sampling.enabled=false" in ov and "grpo.max_duration_s=60.0" in ov
        assert f"logger.log_dir={tmp_path / ('rloo' if ov is grpo else 'gae') / 'logs'}" in ov
        assert ov.index("policy.optimizer.lr=1e-4") > ov.index("grpo.num_prompts_per_step=32")  # the user's last


def test_every_variant_config_loads(tmp_path):
    from nemo_like.config import load_config

    for name, (_, path, _) in ce.VARIANTS.items():
        cfg = load_config(path, ce.variant_overrides(name, steps=3, seconds=None, val_samples=8, val_period=1,
                                                     prompts=32, generations=4, work=tmp_path, user=[]))
        assert cfg.grpo.advantage_estimator == name and not cfg.grpo.dynamic_sampling.enabled
        assert cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt == 128
        assert (cfg.critic is not None) == (name == "gae")
