"""Step environments: the gymnasium wrapper, name resolution through STEP_ENV_REGISTRY, and the Catch
game (its dynamics checked against action sequences worked out by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_like.gym.catch import CatchEnvironment
from nemo_like.gym.step_env import (
    STEP_ENV_REGISTRY,
    GymnasiumEnvironment,
    ObsSpec,
    StepEnvironment,
    check_step_env_name,
    make_step_env,
    register_step_env,
)


# ---- gymnasium -------------------------------------------------------------------------------------
def test_cartpole_spec_reset_and_step():
    env = GymnasiumEnvironment("CartPole-v1")
    spec = env.spec()
    assert spec == ObsSpec(num_actions=2, vector_dim=4)
    assert spec.kind == "vector"
    obs = env.reset(seed=123)
    assert obs.shape == (4,) and obs.dtype == np.float32
    np.testing.assert_array_equal(env.reset(seed=123), obs)
    np.testing.assert_array_equal(GymnasiumEnvironment("CartPole-v1").reset(seed=123), obs)
    assert not np.array_equal(env.reset(seed=124), obs)

    env.reset(seed=0)
    obs2, reward, terminated, truncated, info = env.step(1)
    assert obs2.shape == (4,) and obs2.dtype == np.float32
    assert type(reward) is float and reward == 1.0
    assert type(terminated) is bool and type(truncated) is bool and not terminated and not truncated
    assert isinstance(info, dict)
    env.close()


def test_cartpole_actions_steer_the_cart():
    # Action 1 pushes right, 0 left: after a few pushes the cart velocity (obs[1]) has that sign.
    env = GymnasiumEnvironment("CartPole-v1")
    env.reset(seed=0)
    for _ in range(3):
        right = env.step(1)[0]
    env.reset(seed=0)
    for _ in range(3):
        left = env.step(0)[0]
    assert right[1] > 0 > left[1]


def test_acrobot_has_three_actions():
    env = make_step_env("Acrobot-v1")
    assert isinstance(env, GymnasiumEnvironment)
    assert env.spec().num_actions == 3 and env.spec().vector_dim == 6
    env.reset(seed=0)
    for action in (0, 1, 2):
        obs, reward, *_ = env.step(action)
        assert obs.shape == (6,) and reward == -1.0


def test_continuous_action_space_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Pendulum-v1.*not Discrete"):
        GymnasiumEnvironment("Pendulum-v1")


def test_max_episode_steps_truncates():
    env = make_step_env("CartPole-v1", max_episode_steps=3)
    env.reset(seed=0)
    flags = []
    for action in (0, 1, 0):
        _, _, terminated, truncated, _ = env.step(action)
        flags.append((terminated, truncated))
    assert flags == [(False, False), (False, False), (False, True)]


def test_obs_spec_refuses_degenerate_specs():
    with pytest.raises(ValueError, match="at least 2"):
        ObsSpec(num_actions=1, vector_dim=3)
    with pytest.raises(ValueError, match="vector_dim"):
        ObsSpec(num_actions=2)
    assert ObsSpec(num_actions=2, vector_dim=2, image_shape=(1, 4, 4)).kind == "image+vector"
    assert ObsSpec(num_actions=2, image_shape=(1, 4, 4)).kind == "image"


# ---- resolving names --------------------------------------------------------------------------------
class _Coin(StepEnvironment):
    """Two actions, one step: reward 1 for action 1."""

    def __init__(self, bias: float = 0.0, max_episode_steps: int | None = None) -> None:
        self.bias, self.max_episode_steps = bias, max_episode_steps

    def spec(self) -> ObsSpec:
        return ObsSpec(num_actions=2, vector_dim=1)

    def reset(self, seed: int):
        return np.array([self.bias], dtype=np.float32)

    def step(self, action: int):
        return np.array([self.bias], dtype=np.float32), float(action), True, False, {}


def test_make_step_env_resolves_a_registered_class_with_its_kwargs():
    with STEP_ENV_REGISTRY.isolated():
        register_step_env("coin-test", _Coin)
        check_step_env_name("coin-test")
        env = make_step_env("coin-test", bias=0.5)
        assert isinstance(env, _Coin) and env.bias == 0.5 and env.max_episode_steps is None
        assert make_step_env("coin-test", max_episode_steps=7).max_episode_steps == 7
        assert env.step(1)[1] == 1.0
    assert "coin-test" not in STEP_ENV_REGISTRY
    with pytest.raises(KeyError, match="coin-test"):
        make_step_env("coin-test")


def test_make_step_env_resolves_builtins_and_gymnasium_ids():
    catch = make_step_env("Catch-v0", rows=6, columns=4)
    assert isinstance(catch, CatchEnvironment)
    assert catch.spec() == ObsSpec(num_actions=3, image_shape=(1, 6, 4))
    cart = make_step_env("CartPole-v1")
    assert isinstance(cart, GymnasiumEnvironment) and cart.env_id == "CartPole-v1"
    check_step_env_name("CartPole-v1")
    check_step_env_name("Catch-v0")


def test_unknown_id_suggests_the_closest():
    with pytest.raises(KeyError, match=r"did you mean 'CartPole-v1'") as err:
        make_step_env("CartPol-v1")
    assert "register_step_env" in str(err.value)
    with pytest.raises(KeyError, match="CartPol-v1"):
        check_step_env_name("CartPol-v1")


def test_registering_a_non_callable_or_a_class_without_step_is_refused():
    class NoStep:
        def spec(self):
            return ObsSpec(num_actions=2, vector_dim=1)

        def reset(self, seed):
            return np.zeros(1, dtype=np.float32)

    with STEP_ENV_REGISTRY.isolated():
        with pytest.raises(TypeError, match="not a class or factory"):
            register_step_env("bad-value", 42)
        with pytest.raises(TypeError, match=r"NoStep has no step\(\)"):
            register_step_env("bad-class", NoStep)
        assert "bad-value" not in STEP_ENV_REGISTRY and "bad-class" not in STEP_ENV_REGISTRY
        # An import path is checked when first resolved.
        register_step_env("lazy-bad", "math.pi")
        with pytest.raises(TypeError, match="not a class or factory"):
            make_step_env("lazy-bad")


# ---- Catch ------------------------------------------------------------------------------------------
def _ball_column(obs: np.ndarray) -> int:
    return int(np.argmax(obs[0, 0]))


def _paddle_column(obs: np.ndarray) -> int:
    return int(np.argmax(obs[0, -1]))


def test_catch_spec_and_first_observation():
    env = CatchEnvironment()
    assert env.spec() == ObsSpec(num_actions=3, image_shape=(1, 10, 5))
    obs = env.reset(seed=0)
    assert obs.shape == (1, 10, 5) and obs.dtype == np.float32
    assert obs.sum() == 2.0  # the ball and the paddle
    assert obs[0, 0].sum() == 1.0 and obs[0, -1].sum() == 1.0
    assert _paddle_column(obs) == 2  # the paddle starts in the middle column


def test_catch_ball_column_is_chosen_by_the_seed():
    columns = [_ball_column(CatchEnvironment().reset(seed=s)) for s in range(50)]
    again = [_ball_column(CatchEnvironment().reset(seed=s)) for s in range(50)]
    assert columns == again
    assert len(set(columns)) >= 3
    assert set(columns) <= set(range(5))


def _seed_with_ball_in(column: int) -> int:
    for s in range(200):
        if _ball_column(CatchEnvironment().reset(seed=s)) == column:
            return s
    raise AssertionError(f"no seed in 0..199 puts the ball in column {column}")


@pytest.mark.parametrize(
    "ball, actions, reward",
    [
        # paddle starts in column 2; 9 steps (rows - 1) until the ball reaches the bottom row.
        (0, [0, 0] + [1] * 7, 1.0),       # two lefts: 2 -> 0
        (0, [0] + [1] * 8, -1.0),         # one left: ends in column 1
        (4, [1] * 7 + [2, 2], 1.0),       # rights at the last moment still count
        (4, [2] * 9, 1.0),                # the paddle stops at the wall
        (2, [1] * 9, 1.0),                # stay
        (2, [0, 2] * 4 + [2], -1.0),      # ends one column right
        (1, [2, 0, 0] + [1] * 6, 1.0),    # 2 -> 3 -> 2 -> 1
        (3, [0] * 9, -1.0),
    ],
)
def test_catch_episode_reward(ball, actions, reward):
    assert len(actions) == 9
    env = CatchEnvironment()
    obs = env.reset(seed=_seed_with_ball_in(ball))
    assert _ball_column(obs) == ball
    for t, action in enumerate(actions):
        obs, r, terminated, truncated, info = env.step(action)
        assert not truncated and info == {}
        assert int(np.argmax(obs[0, :, ball])) == t + 1  # the ball falls one row per step, same column
        if t < len(actions) - 1:
            assert (r, terminated) == (0.0, False)
    assert terminated and r == reward
    expected_paddle = 2
    for action in actions:
        expected_paddle = min(max(expected_paddle + action - 1, 0), 4)
    assert obs[0, -1, expected_paddle] == 1.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step(1)


def test_catch_with_vector_gives_paddle_and_time():
    env = CatchEnvironment(with_vector=True)
    assert env.spec() == ObsSpec(num_actions=3, vector_dim=2, image_shape=(1, 10, 5))
    obs = env.reset(seed=3)
    assert set(obs) == {"image", "vector"}
    assert obs["image"].shape == (1, 10, 5) and obs["vector"].shape == (2,)
    assert obs["vector"].dtype == np.float32
    np.testing.assert_allclose(obs["vector"], [0.5, 0.0])  # paddle in column 2 of 0..4, t=0
    obs, *_ = env.step(2)
    np.testing.assert_allclose(obs["vector"], [0.75, 1 / 9])
    assert _paddle_column(obs["image"]) == 3
    plain = CatchEnvironment()
    plain.reset(seed=3)
    np.testing.assert_array_equal(obs["image"], plain.step(2)[0])  # the same board as without the vector


def test_catch_refuses_invalid_actions_and_steps_before_reset():
    env = CatchEnvironment()
    with pytest.raises(RuntimeError, match="reset"):
        env.step(1)  # never reset
    ball = _ball_column(env.reset(seed=0))
    for bad in (3, -1, 7):
        with pytest.raises(ValueError, match="action must be 0"):
            env.step(bad)
    obs, r, terminated, _, _ = env.step(1)  # a refused action did not advance the episode
    assert obs[0, 1, ball] == 1.0 and obs[0, 0].sum() == 0.0
    assert (r, terminated) == (0.0, False)
    with pytest.raises(ValueError, match="rows >= 3"):
        CatchEnvironment(rows=2)


def test_catch_truncates_at_max_episode_steps():
    env = CatchEnvironment(max_episode_steps=4)
    env.reset(seed=0)
    flags = [env.step(1)[2:4] for _ in range(4)]
    assert flags == [(False, False)] * 3 + [(False, True)]
    with pytest.raises(RuntimeError):
        env.step(1)
