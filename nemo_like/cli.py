"""Shared CLI plumbing: bad input exits with code 2 and one line that names the problem."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from nemo_like.config import ConfigError, MasterConfig, load_config, parse_cli


def run_cli(argv: list[str], default_config: str | Path, run: Callable[[MasterConfig], None]) -> int:
    from nemo_like.data.datasets import DataError

    try:
        path, overrides = parse_cli(argv, default_config)
        config = load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(config)
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
