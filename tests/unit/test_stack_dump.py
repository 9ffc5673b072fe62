"""NEMO_LIKE_STACKS_ON_SIGUSR1=1: a process that imported nemo_like prints every thread's stack on
SIGUSR1 and keeps running (how a hung check on a lent GPU is asked where it is)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = """
import sys, time
import nemo_like
def waiting_in_a_named_function():
    print("ready", flush=True)
    time.sleep(30)
waiting_in_a_named_function()
"""


def _run(env_value: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "NEMO_LIKE_STACKS_ON_SIGUSR1"}
    if env_value is not None:
        env["NEMO_LIKE_STACKS_ON_SIGUSR1"] = env_value
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    alive = proc.poll() is None
    proc.kill()
    _, err = proc.communicate(timeout=10)
    return alive, err


def test_sigusr1_prints_the_stacks_and_the_process_lives_on() -> None:
    alive, err = _run("1")
    assert alive
    assert "waiting_in_a_named_function" in err and ("Current thread" in err or "Thread 0x" in err)


def test_without_the_variable_sigusr1_keeps_its_default_action() -> None:
    alive, err = _run(None)
    assert not alive and "waiting_in_a_named_function" not in err
