#!/usr/bin/env bash
# Run THERE, on the lent GPU machine, in the repo root (the second device call of
# benchmarks/README.md "On a lent GPU"; prepare.sh made what it carries). Installs the carried
# wheels, then runs the CUDA checks one after the other, each under its own time limit and all
# within BUDGET_S seconds (a check that would not fit in what is left is skipped, and says so).
# Each check's output goes to $OUT/<check>.log and one line per check to $OUT/summary.txt, so a
# check that fails or hangs still leaves the others' results. ONLY="generation grpo" runs those.
#
# The checks (issue 30's GPU acceptance, in this order):
#   env         the GPU, torch, and that the project, Ray and TRL import
#   cuda_tests  tests/unit/models/test_cuda.py: continuous engine = generate on CUDA; a training step
#               and an object-store refit between a trainer and a rollout worker sharing the GPU; the
#               critic in bf16 and the reward model on the GPU against float32 on the CPU
#   generation  bench_generation.py --device cuda: tokens/s at batch 256, SmolLM2-135M shape, bf16: HF
#               generate, the continuous engine's dynamic, static and CUDA-graph decode steps
#               (policy.generation.decode_mode), transformers' generate_batch
#   smollm2     the SmolLM2 recipe (grpo_smollm2_cpu.yaml) on the GPU in bf16 through Ray, for
#               SMOL_S seconds of training: held-out accuracy before and after, per-phase timing
#               and the perf/ metrics (tokens/s, peak memory, MFU) of metrics.jsonl
#   megatron    benchmarks/device/megatron_check.py on the converted SmolLM2 folder: Megatron-core
#               GPTModel log-probs against HF's on the same weights, a training step, export to HF
#   trl         compare_trl.py on the same recipe and GPU, TRL_STEPS steps each side
#   async       bench_async.py, sync against async (trainer and one rollout worker on half the GPU
#               each, max_staleness 1) on the multi-env default as it is (no tool latency),
#               ASYNC_STEPS steps each
#   endpoint    bench_agent_endpoint.py --parts load: 256 concurrent two-turn chat sessions over HTTP
#               against the OpenAI-compatible server over SmolLM2 on the GPU, tokens/s against the same
#               prompts given to its engine directly (the decode mode the generation check chose)
#   grpo        (only when named in ONLY) the tiny math default on the GPU, GRPO_STEPS steps
# The NCCL refit between two groups needs two GPUs: one machine of one GPU cannot run it (NCCL
# refuses two ranks on one device), so it is not among these checks.
set -uo pipefail
export OUT=${OUT:-/tmp/acceptance_out}
BUDGET_S=${BUDGET_S:-580}
GRPO_STEPS=${GRPO_STEPS:-10}
ASYNC_STEPS=${ASYNC_STEPS:-6}
SMOL_S=${SMOL_S:-100}
TRL_STEPS=${TRL_STEPS:-6}
ONLY=${ONLY:-env cuda_tests generation smollm2 megatron trl async endpoint}
mkdir -p "$OUT"
start=$(date +%s)
summary="$OUT/summary.txt"
: > "$summary"

# ---- install what was carried ------------------------------------------------------------------
if ! ls /root/stash/big.part.* > /dev/null 2>&1; then
  echo "install: /root/stash/big.part.* missing: the stash calls (carry .carry_stashN) did not run on this machine" | tee -a "$summary"
  exit 1
fi
cat /root/stash/big.part.* > /tmp/big.tar
if [ "$(sha256sum /tmp/big.tar | cut -d' ' -f1)" != "$(cat .carry_deps/BIG_SHA256)" ]; then
  echo "install: the reassembled big.tar's sha256 differs from prepare.sh's (a stash part missing?)" | tee -a "$summary"
  exit 1
fi
mkdir -p /tmp/big && tar xf /tmp/big.tar -C /tmp/big && rm /tmp/big.tar
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
     /tmp/big/ray-*.whl .carry_deps/*.whl > "$OUT/install.log" 2>&1; then
  echo "install: pip failed (install.log)" | tee -a "$summary"
  exit 1
fi
rm -f "$OUT/install.log"
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
export NEMO_LIKE_CACHE="$PWD/.carry_models" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
# A check about to be killed at its limit is first asked for its Python stacks (nemo_like/__init__.py).
export NEMO_LIKE_STACKS_ON_SIGUSR1=1
echo "install: done in $(( $(date +%s) - start )) s" >> "$summary"
# A step past 5 x the median (at least 20 s), or a first step past 90 s, prints every process's stacks
# and stops with one line naming the wait (grpo.stall_watch): a hang says where it is within its check.
SMOL=(--config examples/configs/grpo_smollm2_cpu.yaml "policy.model_name=gguf:$(ls /tmp/big/*.gguf)"
      cluster.gpus_per_worker=1 cluster.cpus_per_worker=4 cluster.num_cpus=8 policy.precision=bfloat16
      grpo.stall_watch.factor=5 grpo.stall_watch.min_s=20 grpo.stall_watch.after=2 grpo.stall_watch.first_s=90)

# The code environment's sandbox is bubblewrap; an image without it grades code unsandboxed (rlimits only).
SANDBOX=()
if ! command -v bwrap > /dev/null; then
  SANDBOX=(env.code.allow_unsandboxed=true)
  echo "note: no bwrap on this machine: the code environment runs unsandboxed" >> "$summary"
fi

# ---- the checks ---------------------------------------------------------------------------------
check() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $ONLY " in *" $name "*) ;; *) return ;; esac
  local left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, ${left} s of the budget left" >> "$summary"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0
  t0=$(date +%s)
  # 8 s before the limit, every process of the check that imported nemo_like (the driver, Ray's
  # workers and actors) prints its threads' stacks: a hang says where it is.
  ( sleep $((limit > 12 ? limit - 8 : limit)); pkill -USR1 -f '^ray::' ; pkill -USR1 -f '^(/[^ ]*/)?python3 .*(examples/|benchmarks/|pytest)' ) \
    > /dev/null 2>&1 &
  local watcher=$!
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  kill "$watcher" > /dev/null 2>&1
  if [ $rc -eq 124 ]; then  # the Ray workers' stacks went to their own log files
    for f in /tmp/ray/session_latest/logs/worker-*.err; do
      grep -q "most recent call first" "$f" 2> /dev/null && { echo "=== $f"; grep -v '^\s*$' "$f" | tail -80; }
    done >> "$OUT/$name.log"
  fi
  local what=passed
  [ $rc -ne 0 ] && what="FAILED rc=$rc"
  [ $rc -eq 124 ] && what="TIMED OUT after $limit s"
  echo "$name: $what in $(( $(date +%s) - t0 )) s" >> "$summary"
  ray stop --force > /dev/null 2>&1 || true  # a check that died leaves no Ray behind for the next
}

check env 40 bash -c 'nvidia-smi; python3 -c "
import torch, transformers, ray, pydantic, datasets, trl, megatron.core
import nemo_like.algorithms.grpo
from nemo_like.data.reasoning_gym_tasks import import_reasoning_gym
import_reasoning_gym()  # with stand-ins for the generators left out (pycosat, cellpylib, zss)
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"transformers\", transformers.__version__, \"ray\", ray.__version__, \"pydantic\", pydantic.__version__,
      \"trl\", trl.__version__, \"megatron-core\", megatron.core.__version__)
try:  # torch.compile on CUDA (decode_mode: graphs) needs it
    import triton; print(\"triton\", triton.__version__)
except ImportError as e:
    print(\"no triton:\", e)
"'
check cuda_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/unit/models/test_cuda.py
check generation 170 python3 benchmarks/bench_generation.py --device cuda --reps 2 --compile-timeout 120 \
  --engines continuous,continuous:static,continuous:graphs,generate_batch
# The recipe decodes with CUDA graphs when the generation check found them equal to generate and faster
# than the dynamic step; else as before (the summary says which).
DECODE=$(python3 - "$OUT/generation.log" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1], errors="replace") if __import__("os").path.exists(sys.argv[1]) else []:
    cells = [c.strip() for c in line.split("|")]
    if len(cells) == 8 and cells[2].startswith("continuous"):
        try:
            rows[cells[2]] = (float(cells[3].replace(",", "")), cells[7])
        except ValueError:
            pass
g, d = rows.get("continuous:graphs"), rows.get("continuous")
print("graphs" if g and d and g[1].startswith("equal") and g[0] > d[0] else "dynamic")
PY
)
echo "decode_mode for the recipe: $DECODE" >> "$summary"
SMOL+=(policy.generation.decode_mode="$DECODE")
check smollm2 $((SMOL_S + 70)) python3 examples/run_grpo_math.py "${SMOL[@]}" grpo.max_duration_s="$SMOL_S" \
  grpo.max_num_steps=1000 grpo.val_period=10 checkpointing.enabled=false logger.log_dir=/tmp/smollm2_cuda \
  logger.tensorboard_enabled=false
[ -f /tmp/smollm2_cuda/metrics.jsonl ] && cp /tmp/smollm2_cuda/metrics.jsonl "$OUT/smollm2_metrics.jsonl"
check megatron 130 bash -c 'python3 benchmarks/device/megatron_check.py --json "$OUT/megatron.json" --model "$(python3 -c "
import sys; from nemo_like.models.pretrained import resolve_model_source; print(resolve_model_source(sys.argv[1]))
" "gguf:$(ls /tmp/big/*.gguf)")" && python3 examples/run_grpo_math.py "$@" policy.backend=megatron \
  policy.sequence_packing.enabled=false policy.generation.colocated=false cluster.gpus_per_worker=0.5 \
  cluster.generation.gpus_per_worker=0.5 cluster.generation.cpus_per_worker=4 grpo.max_num_steps=3 \
  grpo.val_at_start=false grpo.val_at_end=false checkpointing.enabled=false logger.log_dir=/tmp/megatron_grpo \
  logger.tensorboard_enabled=false' megatron "${SMOL[@]}"
[ -f /tmp/megatron_grpo/metrics.jsonl ] && cp /tmp/megatron_grpo/metrics.jsonl "$OUT/megatron_grpo_metrics.jsonl"
check trl 110 python3 benchmarks/compare_trl.py --steps "$TRL_STEPS" --warmup 2 --val-samples 64 \
  --json "$OUT/trl.json" "${SMOL[@]}" grpo.val_period=0
check async 80 python3 benchmarks/bench_async.py --steps "$ASYNC_STEPS" --latency 0 --rollout-workers 1 \
  --png /tmp/bench_async.png --json "$OUT/async.json" cluster.gpus_per_worker=0.5 \
  cluster.generation.gpus_per_worker=0.5 policy.precision=bfloat16 cluster.num_cpus=16 cluster.cpus_per_worker=8 \
  "${SANDBOX[@]}"
check endpoint 100 python3 benchmarks/bench_agent_endpoint.py --parts load --sessions 256 --slots 256 --tokens 64 \
  --model "gguf:$(ls /tmp/big/*.gguf)" --decode-mode "$DECODE" --json "$OUT/endpoint.json"
check grpo 120 python3 examples/run_grpo_math.py cluster.gpus_per_worker=1 cluster.cpus_per_worker=4 \
  cluster.num_cpus=8 policy.precision=bfloat16 grpo.max_num_steps="$GRPO_STEPS" grpo.val_period="$GRPO_STEPS" \
  grpo.max_val_samples=200 checkpointing.enabled=false logger.log_dir=/tmp/grpo_cuda logger.tensorboard_enabled=false
[ -f /tmp/grpo_cuda/metrics.jsonl ] && cp /tmp/grpo_cuda/metrics.jsonl "$OUT/grpo_metrics.jsonl"
echo "total: $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
