#!/usr/bin/env bash
# The first GPU run, prepared: one command of at most 8 minutes on the lent image (one H200, Python 3.12 as
# `python3`, torch 2.11, no network; tyro, webdataset and fla travel as wheels). Every result goes to
# $GPU_CHECK_OUT/gpu_check.json (one entry per check, benchmarks/gpu_report.py); a readable table comes last.
#
#   boot      installs the carried wheels (--target, PYTHONPATH), prints versions, the kernels present and what
#             this torch lacks (hyper_parallel.torch_features)
#   A         packed attention: the varlen kernel vs a per-document fp32 reference, determinism, peak memory
#   B         grouped matmul: bf16 experts through grouped_mm == the per-expert loop
#   C         chunked loss == F.cross_entropy on fp32 logits, lower peak memory
#   G         Gated DeltaNet on fla's Triton kernels (and its Triton conv) vs our torch path, 8k and 32k tokens
#   M         real width: 4 layers of Qwen3.5-35B-A3B and of GLM-4.7-Flash, bf16, full AC, 8192-token packed
#             micro-batches (log-normal documents), 5 warm-up + 10 timed steps through the Trainer: tokens/s,
#             TFLOP/s, MFU vs 989 and vs the measured matmul peak; memory vs the dry run; syncs of one steady step
#             (torch.cuda.set_sync_debug_mode); one profiled step; the same slice compiled (benchmarks/gpu_slice.py)
#   F         determinism on the bf16 kernel path: two runs of each debug recipe, bitwise the same losses
#   D         a bf16 step of the debug recipe through the CLI (torchrun, every visible GPU)
#   E         async checkpoint + resume continues from it
#   N         what one GPU cannot check (EP, CP, FSDP over NCCL between ranks) is recorded as such
#
#   bash benchmarks/gpu_wheels.sh .whl                      # here, with PyPI: the wheels the image lacks
#   GPU_CHECK_OUT=$OUT bash benchmarks/gpu_check.sh         # there: carry .whl, PYTHON=python3 by default
#   GPU_CHECK_OUT=/tmp/gc bash benchmarks/gpu_check.sh --cpu   # the whole script at tiny width on CPU (the suite runs it)
#   ONLY=AM bash benchmarks/gpu_check.sh                    # a subset (boot always runs)
#
# GPU_CHECK_BUDGET (seconds, default 450) stops starting checks once spent, recorded as SKIP; each check also has
# its own time limit. The exit status is the number of failed checks.
set -uo pipefail
ONLY=${ONLY:-ABCGMFDEN}
cd "$(dirname "$0")/.."
DEV=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEV=cpu; fi
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ $DEV == cpu && -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export DEV PYTHONUNBUFFERED=1
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-$PWD/outputs/gpu_check}
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (check F)
BUDGET=${GPU_CHECK_BUDGET:-450}
WORK=$(mktemp -d -t gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$GPU_CHECK_OUT/parts" && mkdir -p "$GPU_CHECK_OUT"
report() { "$PY" benchmarks/gpu_report.py "$@"; }

# ---- boot: the carried wheels, then versions and kernels
WHEELS=${GPU_WHEELS:-.whl}
SITE=""
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$WORK/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    || echo "boot: installing the wheels of $WHEELS failed"
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY' || { report finalize; exit 1; }
import importlib, os, sys
sys.path.insert(0, "benchmarks")
from gpu_report import record
import torch
dev = os.environ["DEV"]
versions = {"python": sys.version.split()[0], "torch": torch.__version__}
for name in ("triton", "transformers", "tyro", "webdataset", "fla", "flash_attn", "causal_conv1d", "safetensors"):
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", "present")
    except ImportError:
        versions[name] = None
try:
    from hyper_parallel import torch_features
    from hyper_parallel.models.common import attention as A, gated_delta_rule as gdr
except ImportError as e:  # tyro & co. missing: nothing else can run
    record("boot", "FAIL", f"hyper_parallel does not import ({e}); carry the wheels: bash benchmarks/gpu_wheels.sh .whl", **versions)
    raise SystemExit(1)
kernels = {"flash_attn": A.flash_attn_varlen_func is not None, "torch varlen_attn": A.varlen_attn is not None,
           "fla chunk_gated_delta_rule": gdr.fla_chunk_gated_delta_rule is not None,
           "causal_conv1d": gdr.causal_conv1d_fn is not None, "fla Triton conv": gdr.fla_causal_conv1d is not None,
           "grouped_mm": torch_features.has("grouped_mm")}
gpu = {}
if torch.cuda.is_available():
    gpu = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
           "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}
elif dev == "cuda":
    record("boot", "FAIL", "no CUDA device visible (run with --cpu to test the script on CPU)", **versions)
    raise SystemExit(1)
line = (f"torch {torch.__version__} on {gpu.get('gpu', 'cpu')}; kernels: "
        + ", ".join(k for k, v in kernels.items() if v) + "; missing: " + (", ".join(k for k, v in kernels.items() if not v) or "none"))
print(line)
print(torch_features.describe())
record("boot", "PASS", line, versions=versions, kernels=kernels, torch_features=torch_features.describe(), **gpu)
PY

if [[ $DEV == cuda ]]; then
  NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
  BF16=bfloat16 STEPS=3 DET_MODULES="glm_image_moe qwen3_5_moe"
else  # --cpu only tests the script: fp32 (bf16 matmuls crawl on CPU), fewer steps, one recipe for F
  NGPU=1 BF16=float32 STEPS=1 DET_MODULES=glm_image_moe
fi
export PY WORK BF16 NGPU STEPS DET_MODULES PYTHONPATH

launch() {  # the CLI: torchrun over every visible GPU, or one CPU process
  if [[ $DEV == cuda ]]; then "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m hyper_parallel.train "$@"
  else "$PY" -m hyper_parallel.train "$@"; fi
}

run_check() {  # run_check LETTER NAME LIMIT CMD...: the command records its own entry; a crash or timeout records FAIL
  local letter=$1 name=$2 limit=$3 rc=0
  shift 3
  if [[ "$ONLY" != *"$letter"* ]]; then return 0; fi
  if (( SECONDS > BUDGET )); then
    report record "$name" SKIP "not started: the ${BUDGET}s budget was spent (${SECONDS}s)"; return 0
  fi
  local t0=$SECONDS
  if [[ $DEV == cpu ]]; then limit=$((limit * 3)); fi  # a shared CPU is slow to start processes; only tests the script
  echo "== $name ($((BUDGET - SECONDS))s of budget left, limit ${limit}s)"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" || rc=$?
  if [[ $rc -ne 0 && ! -f "$GPU_CHECK_OUT/parts/$name.json" ]] && ! compgen -G "$GPU_CHECK_OUT/parts/$name.*.json" >/dev/null; then
    report record "$name" FAIL "exit $rc after $((SECONDS - t0))s$([[ $rc -eq 124 ]] && echo " (over its ${limit}s limit)")"
  fi
}

train() {  # train DIR ARGS...: a debug recipe through the CLI, logs to DIR.log
  local dir=$1
  shift
  launch --dump_folder "$dir" --metrics.log_freq 1 "$@" >"$dir.log" 2>&1
}

losses() { grep -o 'loss [0-9.]* | gnorm [0-9.]*' "$1" || true; }  # every step's loss and grad norm

check_bf16_step() {
  local dir=$WORK/bf16 rc=0
  train "$dir" --module glm_image_moe --config glm_image_moe_debug --training.steps "$STEPS" \
    --training.mixed_precision_param "$BF16" --checkpoint.no_enable || rc=$?
  local done speed
  done=$(grep -o 'done: .*' "$dir.log" || true)
  speed=$(grep -oE 'tps [0-9,]+' "$dir.log" | tail -1 | tr -d ',')
  if [[ $rc -eq 0 && -n "$done" && "$done" != *nan* && "$done" != *inf* ]]; then
    report record D.bf16_step PASS "$DEV $BF16 debug recipe through the CLI: $done; ${speed:-tps ?}" \
      "tokens_per_s=${speed#tps }"
  else
    report record D.bf16_step FAIL "exit $rc: $(tail -1 "$dir.log" | cut -c1-200)"; return 1
  fi
}

check_async_checkpoint() {
  local dir=$WORK/ckpt rc=0 first=$((STEPS + 1)) last=$((STEPS + 3)) args=(--module glm_image_moe
    --config glm_image_moe_debug --checkpoint.enable --checkpoint.interval 1 --checkpoint.async_mode async)
  train "$dir" "${args[@]}" --training.steps "$first" || rc=$?
  local saved
  saved=$(ls "$dir/checkpoint" 2>/dev/null | grep -c '^step-[0-9]*$' || true)
  train "$dir" "${args[@]}" --training.steps "$last" || rc=$?
  if [[ $rc -eq 0 && $saved -ge 1 ]] && grep -q "resumed from .*step-$first" "$dir.log" && grep -q "step *$last/$last" "$dir.log"; then
    report record E.async_checkpoint PASS "$saved complete checkpoints after $first steps, resumed at step $first, ran to step $last"
  else
    report record E.async_checkpoint FAIL "exit $rc, $saved checkpoints: $(tail -1 "$dir.log" | cut -c1-200)"; return 1
  fi
}

check_deterministic() {  # the bf16 kernel path (varlen attention, grouped_mm, fla) of two recipes, twice each
  local rc=0 summary="" status=PASS m
  for m in $DET_MODULES; do
    local args=(--module "$m" --config "${m}_debug" --training.steps "$STEPS" --debug.deterministic --checkpoint.no_enable
      --training.mixed_precision_param "$BF16")
    train "$WORK/det1_$m" "${args[@]}" || rc=$?
    train "$WORK/det2_$m" "${args[@]}" || rc=$?
    local a b
    a=$(losses "$WORK/det1_$m.log" | tr '\n' ' ')
    b=$(losses "$WORK/det2_$m.log" | tr '\n' ' ')
    if [[ $rc -ne 0 || -z "$a" || "$a" != "$b" ]]; then status=FAIL; fi
    summary+="$m: ${a:-no losses}$([[ "$a" == "$b" ]] && echo "(same)" || echo "vs $b") "
  done
  report record F.deterministic "$status" "exit $rc; $summary"
  [[ $status == PASS ]]
}

check_slices() {  # M: every real-width slice in one process each
  local extra=() rc=0
  if [[ $DEV == cpu ]]; then
    # tiny width, 2 layers, aot_eager: tests the script, measures nothing
    extra=(--cpu --layers 2 --tokens 128 --doc_tokens 40 --warmup 1 --steps 2 --backend aot_eager)
    "$PY" benchmarks/gpu_slice.py --module qwen3_5_moe --config qwen3_5_moe_debug --name M.qwen3_5_moe "${extra[@]}" --compile || rc=$?
    "$PY" benchmarks/gpu_slice.py --module glm_image_moe --config glm_image_moe_debug --name M.glm_image_moe "${extra[@]}" || rc=$?
  else
    "$PY" benchmarks/gpu_slice.py --module qwen3_5_moe --config qwen3_5_moe_a3b --name M.qwen3_5_moe_a3b --compile || rc=$?
    "$PY" benchmarks/gpu_slice.py --module glm_image_moe --config glm_image_moe_a3b --name M.glm_flash --compile || rc=$?
  fi
  return $rc
}

export -f report launch train losses check_bf16_step check_async_checkpoint check_deterministic check_slices
run_check A A.attention 60 "$PY" benchmarks/gpu_checks/attention.py
run_check B B.grouped_mm 60 "$PY" benchmarks/gpu_checks/grouped_mm.py
run_check C C.loss 60 "$PY" benchmarks/gpu_checks/loss.py
run_check G G.deltanet 120 "$PY" benchmarks/gpu_checks/deltanet.py
run_check M M 300 check_slices
run_check F F.deterministic 120 check_deterministic
run_check D D.bf16_step 90 check_bf16_step
run_check E E.async_checkpoint 120 check_async_checkpoint
if [[ "$ONLY" == *N* ]]; then
  report record N.not_checkable INFO \
    "one GPU cannot check EP, CP or FSDP over NCCL between ranks (the gloo system tests cover their math on CPU)"
fi
echo "== done in ${SECONDS}s"
report finalize
