"""GRPO on an agent program. `uv run examples/run_grpo_agent.py [--config PATH] [key=value ...]`

With no arguments it runs examples/configs/grpo_agent_tiny.yaml: the agent in
examples/agents/calculator.py, written only against an OpenAI client, solves the tool task's problems
(call a tool, read its result, answer) by talking to this run's OpenAI-compatible server; the tiny
char-level Llama behind it is trained by GRPO on the exact tokens the server sampled for each episode.
Held-out success is printed before and after, with McNemar's test.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The agent module is named by import path (env.agent.fn: examples.agents.calculator:solve): the
# repository's root must be importable, here and in the Ray actor that runs the episodes.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nemo_like.cli import run_cli, run_grpo  # noqa: E402

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_agent_tiny.yaml"


def main(argv: list[str]) -> int:
    return run_cli(argv, DEFAULT_CONFIG, run_grpo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
