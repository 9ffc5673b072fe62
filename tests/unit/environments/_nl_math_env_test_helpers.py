"""Helpers for test_math_environment: custom verifiers and a user environment."""
import math
import mmap
import os
import time


def misbehaving_verifier(response, truth):
    """Behaviour picked by the response text; otherwise exact match."""
    if response == "sleep":
        with open(truth, "w") as f:  # the ground truth names a file for our pid
            f.write(str(os.getpid()))
        time.sleep(120)
    if response == "raise":
        raise RuntimeError("verifier exploded")
    if response == "nan":
        return math.nan
    if response == "exit":
        os._exit(3)
    if response == "oom":  # lazy mapping: costs no RAM even if the limit were missing
        mmap.mmap(-1, 4 << 30)
        return 1.0
    if response == "print":
        print('{"result": 1.0}')
        print("garbage on stdout")
        return 0.0
    return float(response.strip() == truth.strip())


def slow_verifier(response, truth):
    time.sleep(120)
    return 1.0


class EchoEnv:
    """A user environment: reward 1.0 when the last message is the configured word."""

    def __init__(self, config=None):
        self.word = (config or {}).get("word", "hi")

    def step(self, message_log_batch, metadata):
        return [1.0 if log[-1]["content"] == self.word else 0.0 for log in message_log_batch]

    def pid(self):
        return os.getpid()


class NoStep:
    pass


NOT_A_CLASS = 3
