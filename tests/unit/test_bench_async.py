"""The pure parts of benchmarks/bench_async.py and the statistics it reports (values worked by hand)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from nemo_like.utils.stats import paired_counts, paired_mean_difference, student_t_quantile, student_t_two_sided_p

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_async.py"
_spec = importlib.util.spec_from_file_location("bench_async", _PATH)
ba = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_async", ba)
_spec.loader.exec_module(ba)


def test_student_t_matches_the_closed_forms_and_the_tables():
    # df 1 is Cauchy: P(|T| >= 1) = 1 - (2/pi) atan(1) = 1/2
    assert student_t_two_sided_p(1.0, 1) == pytest.approx(0.5)
    # df 2: P(|T| >= t) = 1 - t / sqrt(2 + t^2); t = sqrt(2) gives 1 - 1/sqrt(2)
    assert student_t_two_sided_p(math.sqrt(2), 2) == pytest.approx(1 - 1 / math.sqrt(2))
    # df 3: (2/pi)(theta + sin cos), theta = atan(t / sqrt 3); t = sqrt(3) gives theta = pi/4:
    # 1 - (2/pi)(pi/4 + 1/2) = 1/2 - 1/pi
    assert student_t_two_sided_p(math.sqrt(3), 3) == pytest.approx(0.5 - 1 / math.pi)
    # df 4: sin(theta) (1 + cos^2 / 2); t = 2 gives theta = pi/4: 1 - (1/sqrt 2)(5/4)
    assert student_t_two_sided_p(2.0, 4) == pytest.approx(1 - 5 / (4 * math.sqrt(2)))
    assert student_t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert student_t_two_sided_p(-2.0, 4) == student_t_two_sided_p(2.0, 4)
    # 97.5% points of the printed tables
    for df, t in [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (10, 2.228)]:
        assert student_t_quantile(0.05, df) == pytest.approx(t, abs=1e-3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_two_sided_p(1.0, 0)


def test_paired_mean_difference_by_hand():
    # diffs -2, 1, -4, 0: mean -1.25, squares about the mean 0.5625 + 5.0625 + 7.5625 + 1.5625 = 14.75,
    # sd sqrt(14.75 / 3); t = -1.25 / (sd / 2)
    r = paired_mean_difference([-2.0, 1.0, -4.0, 0.0])
    sd = math.sqrt(14.75 / 3)
    assert r["n"] == 4 and r["mean"] == -1.25 and r["sd"] == pytest.approx(sd)
    assert r["ci_low"] == pytest.approx(-1.25 - 3.1824 * sd / 2, abs=1e-3)
    assert r["ci_high"] == pytest.approx(-1.25 + 3.1824 * sd / 2, abs=1e-3)
    assert r["p"] == pytest.approx(student_t_two_sided_p(-1.25 / (sd / 2), 3))
    one = paired_mean_difference([3.0])
    assert one["mean"] == 3.0 and math.isnan(one["sd"]) and math.isnan(one["p"])
    assert paired_mean_difference([2.0, 2.0])["p"] == 0.0 and paired_mean_difference([0.0, 0.0])["p"] == 1.0
    with pytest.raises(ValueError):
        paired_mean_difference([])


def test_paired_counts():
    assert paired_counts([True, True, False, False, True], [True, False, True, True, True]) == (2, 1)
    with pytest.raises(ValueError, match="same problems"):
        paired_counts([True], [True, False])


def _run(results: dict[str, list[bool]], lags: dict[str, list[float]] | None = None) -> dict:
    final = {"task_name": [t for t, xs in results.items() for _ in xs], "correct": [x for xs in results.values() for x in xs]}
    steps = [{f"lag/{t}": v[i] for t, v in (lags or {}).items()} for i in range(2)]
    return {"final": final, "steps": steps, "points": [], "wall_s": 1.0}


def test_compare_tasks_pairs_each_seed_and_pools_the_discordant_problems():
    T, F = True, False
    runs = {
        (1, "sync"): _run({"code": [T, T, F, F], "math": [T, F]}),
        (1, "async"): _run({"code": [T, F, F, F], "math": [T, T]}, {"code": [1.0, 0.0], "math": [1.0, 1.0]}),
        (2, "sync"): _run({"code": [T, F, F, F], "math": [F, F]}),
        (2, "async"): _run({"code": [T, F, T, F], "math": [F, F]}, {"code": [1.0, 1.0], "math": [0.0, 1.0]}),
        (3, "sync"): _run({"code": [T, T, T, T], "math": [T, T]}),  # its async side never finished
    }
    rows = ba.compare_tasks(runs)
    code, math_ = rows["code"], rows["math"]
    assert code["seeds"] == [1, 2]
    assert code["sync"] == [50.0, 25.0] and code["async"] == [25.0, 50.0] and code["diff"] == [-25.0, 25.0]
    assert (code["gained"], code["lost"], code["pairs"]) == (1, 1, 8)
    assert code["mcnemar_p"] == 1.0  # 1 of 2 discordant each way
    assert code["seed_test"]["mean"] == 0.0 and code["seed_test"]["p"] == 1.0
    assert math_["diff"] == [50.0, 0.0] and (math_["gained"], math_["lost"]) == (1, 0)
    assert math_["mcnemar_p"] == 1.0  # one discordant pair: p = 2 * 1/2
    assert code["lag_sync"] == [0.0, 0.0] and code["lag_async"] == [0.5, 1.0]
    assert math_["lag_async"] == [1.0, 0.5]


def test_task_lag_per_task_is_steps_behind_the_trained_weights():
    batch = {"policy_version": torch.tensor([3, 2, 3, 3]), "task_name": ["code", "code", "math", "math"]}
    assert ba._task_lag(batch, 3) == {"lag/code": 0.5, "lag/math": 0.0}
    assert ba._task_lag({"task_name": ["code"]}, 3) == {}  # the synchronous loop records no version


def test_saved_run_keys_read_back():
    saved = {"1.0/42/sync": {"wall_s": 1.0}, "0.0/None/async": {"wall_s": 2.0}}
    assert ba._runs_from_json(saved) == {(1.0, 42, "sync"): {"wall_s": 1.0}, (0.0, None, "async"): {"wall_s": 2.0}}
