"""Every Ray worker and actor imports ray: a dependency that makes ``import ray`` slow slows every
actor start of every run. JupyterLab's jsonschema format extra did (rfc3987-syntax builds a grammar on
import: `import ray` took 1.92 s against 0.55 s, and the suite ran 1.5x slower); it stays out."""

from __future__ import annotations

import subprocess
import sys


def test_import_ray_pulls_in_no_grammar_building_format_checker():
    code = "import sys, ray; print(sorted(m for m in ('rfc3987_syntax', 'lark', 'jupyterlab') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
