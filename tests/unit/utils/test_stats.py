import pytest

from nemo_like.utils.stats import mcnemar_exact_p, paired_change


def test_mcnemar_exact_p_values():
    # Two-sided binomial tails, checked by hand: n=3 all one way: 2 * 1/8.
    assert mcnemar_exact_p(3, 0) == pytest.approx(0.25) and mcnemar_exact_p(0, 3) == pytest.approx(0.25)
    assert mcnemar_exact_p(0, 0) == 1.0 and mcnemar_exact_p(5, 5) == 1.0
    # 28 gained, 12 lost: 2 * P(X <= 12), X ~ Bin(40, 1/2) = 0.016589
    assert mcnemar_exact_p(28, 12) == pytest.approx(0.016589, abs=1e-6)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        mcnemar_exact_p(-1, 2)


def test_paired_change_counts_flips():
    before = [True, False, False, True, False]
    after = [True, True, True, False, False]
    assert paired_change(before, after) == "2 gained, 1 lost, McNemar p = 1.000"
    assert paired_change([False] * 20, [True] * 20) == "20 gained, 0 lost, McNemar p < 0.001"
    with pytest.raises(ValueError, match="same problems: 2 before, 3 after"):
        paired_change([True, False], [True, False, True])
