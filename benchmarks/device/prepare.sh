#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), from anywhere in the repo: gathers what the lent GPU
# machine lacks into folders that git ignores and a device call carries (64 MiB per call at most):
#   .carry_ray1/    the first 40 MiB of Ray's Python 3.12 wheel        (call 1 stashes it there)
#   .carry_ray2/    the rest of it and WHEEL_NAME                     (call 2)
#   .carry_deps/    the other wheels the image lacks, at uv.lock's versions (call 2)
#   .carry_models/  the bootstrapped tiny base models of the configs run there ($NEMO_LIKE_CACHE, call 2)
# The GPU image has torch, transformers, peft, accelerate, numpy, pandas, jinja2, sympy, tqdm, tensorboard,
# matplotlib, pyarrow, msgpack... (/work/.library/device/KINDS.md); the list below is what it lacks.
# Then the two device calls of benchmarks/README.md ("On a lent GPU").
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PYVER=${PYVER:-3.12}
NEEDED=(ray pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess gymnasium
        farama-notifications gguf jsonschema jsonschema-specifications referencing rpds-py)

pins=$(uv export --quiet --frozen --no-hashes --no-dev --no-emit-project --format requirements-txt | grep -E '^[A-Za-z0-9_.-]+==' | cut -d' ' -f1)
pin() {  # name -> name==version from uv.lock
  local want=${1//_/-}
  echo "$pins" | awk -F'==' -v n="$want" 'tolower($1) == n {print $1 "==" $2; exit}'
}
for d in .carry_ray1 .carry_ray2 .carry_deps .carry_models; do rm -rf "$d"; mkdir -p "$d"; done
opts=(--no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
specs=()
for name in "${NEEDED[@]}"; do
  spec=$(pin "$name")
  [ -n "$spec" ] || { echo "prepare.sh: $name is not in uv.lock (uv export); fix NEEDED" >&2; exit 1; }
  specs+=("$spec")
done
echo "wheels: ${specs[*]}"
python3 -m pip download -q "${opts[@]}" -d "$tmp" "${specs[@]}"
wheel=$(ls "$tmp"/ray-*.whl)
split -b 40m "$wheel" "$tmp/ray.part."
mv "$tmp/ray.part.aa" .carry_ray1/
mv "$tmp/ray.part.ab" .carry_ray2/
basename "$wheel" > .carry_ray2/WHEEL_NAME
sha256sum "$wheel" | cut -d' ' -f1 > .carry_ray2/SHA256
rm "$wheel"
mv "$tmp"/*.whl .carry_deps/

# The base models the acceptance's configs bootstrap (built here if not cached: a few minutes).
uv run --frozen python - <<'PY'
import shutil
from pathlib import Path

from nemo_like.config import load_config
from nemo_like.distributed.ray_cluster import init_ray, shutdown_ray_if_started
from nemo_like.models.bootstrap import bootstrap_cache_path, ensure_base_model

started = None
for name in ("grpo_math_tiny.yaml", "grpo_multi_env_tiny.yaml"):
    cfg = load_config(f"examples/configs/{name}", [])
    path = bootstrap_cache_path(cfg)
    if not (path / "config.json").exists():
        started = started or init_ray()
        ensure_base_model(cfg)
    shutil.copytree(path, Path(".carry_models") / path.name)
    print(f"{name}: {path.name}")
if started:
    shutdown_ray_if_started(started)
PY
du -sh .carry_ray1 .carry_ray2 .carry_deps .carry_models
echo "tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (call 2 carries it too)"
