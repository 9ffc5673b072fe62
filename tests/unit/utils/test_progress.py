"""Off a terminal a run's output is plain lines: no bar redrawn with carriage returns."""

import subprocess
import sys

SCRIPT = """
from nemo_like.utils.progress import progress_bar, progress_write
with progress_bar(total=3, desc="GRPO", unit="step") as bar:
    for i in range(3):
        progress_write(f"step {i + 1}  reward 0.5")
        bar.update(1)
"""


def _run(env_value: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["NEMO_LIKE_PROGRESS"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, env=env,
                         check=True, timeout=60)
    # bytes: text mode would turn the carriage returns under test into newlines
    return (out.stdout + out.stderr).decode()


def test_off_a_terminal_the_log_is_plain_lines():
    text = _run(None)
    assert "\r" not in text
    assert text.splitlines() == ["step 1  reward 0.5", "step 2  reward 0.5", "step 3  reward 0.5"]


def test_a_bar_can_be_forced_and_then_redraws():
    text = _run("bar")
    assert "\r" in text and "GRPO" in text
    assert "step 3  reward 0.5" in text


def test_off_a_terminal_the_libraries_bars_are_off_too():
    script = ("from nemo_like.utils.progress import quiet_library_bars; quiet_library_bars()\n"
              "import datasets, transformers\n"
              "print(datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False", "False"]


def test_ray_workers_never_draw_library_bars(ray_session):
    import os

    import ray

    @ray.remote(num_cpus=0)
    def worker_env() -> str | None:
        return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")

    assert ray.get(worker_env.remote()) == "1"
