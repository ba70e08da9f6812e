#!/usr/bin/env bash
# Confirm the CUDA paths of the packed training step on a machine with a GPU (CPU CI cannot):
#
#   A  packed attention: the flash varlen kernel (flash_attn, else torch.nn.attention.varlen) runs,
#      matches a per-document fp32 reference (fwd + bwd), is bitwise repeatable under deterministic
#      algorithms, and keeps no [H, L, L] scores (peak memory of one 8192-token document)
#   B  grouped matmul: bf16 experts take the grouped_mm kernel (== per-expert loop), fp32 warns once
#   C  chunked loss: == F.cross_entropy on fp32 logits, with a lower peak memory (vocab 171k x 8k tokens)
#   D  a bf16 FSDP training step of the debug model (torchrun, every visible GPU)
#   E  async checkpoint (pinned staging) + resume continues from it
#   F  --debug.deterministic: two runs give bitwise the same losses
#   G  Gated DeltaNet on the CUDA kernels (causal-conv1d + flash-linear-attention, the `gpu` extra):
#      packed bf16 fwd + bwd == our torch path in fp32, and its speed (SKIP when the packages are missing)
#
# Each check prints one PASS/FAIL line with its numbers; the exit status is the number of failures.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine (NGPU=<n> to use fewer GPUs)
#   bash benchmarks/gpu_check.sh --cpu      # the same checks on CPU (sdpa / fp32 paths), to test the script
#   ONLY=AB bash benchmarks/gpu_check.sh    # a subset of the checks
set -euo pipefail
ONLY=${ONLY:-ABCDEFG}

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then PY=.venv/bin/python; fi
DEV=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEV=cpu; fi
export DEV PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (check F)
WORK=$(mktemp -d -t gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
FAILED=0
RESULTS=()

run_check() {  # run_check NAME CMD...: the command prints its own PASS/FAIL line and exits 0/1
  local name=$1 rc=0
  shift
  if [[ "$ONLY" != *"${name:0:1}"* ]]; then return 0; fi
  echo "== $name"
  "$@" || rc=$?
  if [[ $rc -ne 0 ]]; then
    FAILED=$((FAILED + 1))
    RESULTS+=("FAIL $name (exit $rc)")
  else
    RESULTS+=("PASS $name")
  fi
}

"$PY" - <<'PY'
import os, torch
from hyper_parallel.models.common import attention as A
print(f"torch {torch.__version__}, device {os.environ['DEV']}, cuda available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name()}, {torch.cuda.device_count()} GPUs)" if torch.cuda.is_available() else ""))
print(f"flash_attn: {A.flash_attn_varlen_func is not None}, torch varlen_attn: {A.varlen_attn is not None}")
if os.environ["DEV"] == "cuda" and not torch.cuda.is_available():
    raise SystemExit("FAIL setup: no CUDA device visible (run with --cpu to test the script on CPU)")
PY
if [[ $DEV == cuda ]]; then
  NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
  LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m hyper_parallel.train)
else
  LAUNCH=("$PY" -m hyper_parallel.train)
fi

check_attention() {
  "$PY" - <<'PY'
import os, time, torch, torch.nn.functional as F
from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
# a3b's MLA: 20 heads, qk head dim 256, v head dim 256; CPU: a small stand-in
H, dqk, dv, lengths = (20, 256, 256, [3000, 2000, 1500, 1200, 492]) if cuda else (4, 48, 32, [700, 500, 300, 36])
T, scale = sum(lengths), dqk ** -0.5
g = torch.Generator(device=dev).manual_seed(0)
q, k = (torch.randn(1, H, T, dqk, device=dev, dtype=dtype, generator=g) for _ in range(2))
v = torch.randn(1, H, T, dv, device=dev, dtype=dtype, generator=g)
grad = torch.randn(1, T, H, dv, device=dev, dtype=dtype, generator=g)
cu = torch.tensor([0, *lengths], device=dev).cumsum(0).to(torch.int32)
attn = VarlenAttention.Config(backend="auto").build()
kernel = attn.kernel(q)

def run(module, det=False):
    torch.use_deterministic_algorithms(det)
    try:
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        meta = AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths), cu_seqlens_host=cu.tolist())
        out = module(*xs, scale=scale, meta=meta)
        out.backward(grad)
        return out.detach(), [x.grad for x in xs]
    finally:
        torch.use_deterministic_algorithms(False)

out, grads = run(attn)
ref_outs, ref_grads = [], [torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v)]
for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
    xs = [x[:, :, s:e].float().requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*xs, is_causal=True, scale=scale).transpose(1, 2)
    o.backward(grad[:, s:e].float())
    ref_outs.append(o.detach())
    for acc, x in zip(ref_grads, xs):
        acc[:, :, s:e] = x.grad
ref = torch.cat(ref_outs, dim=1)
rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
err_out = rel(out, ref)
err_grad = max(rel(a, b) for a, b in zip(grads, ref_grads))
_, g1 = run(attn, det=True)
_, g2 = run(attn, det=True)
repeatable = all(torch.equal(a, b) for a, b in zip(g1, g2))

def timed(module, n=5):
    run(module)
    if cuda: torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        run(module)
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

ms_kernel = timed(attn)
ms_sdpa = timed(VarlenAttention.Config(backend="sdpa").build())
peak_gb = float("nan")
if cuda:  # one 8192-token document: the math kernel would keep [20, 8192, 8192] fp32 scores (5.4 GB)
    big = [torch.randn(1, H, 8192, d, device=dev, dtype=dtype, requires_grad=True) for d in (dqk, dqk, dv)]
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 8192], device=dev, dtype=torch.int32), max_seqlen=8192,
                         cu_seqlens_host=[0, 8192])
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attn(*big, scale=scale, meta=meta).sum().backward()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - base) / 2**30
tol, tol_grad = (2e-2, 5e-2) if cuda else (1e-5, 1e-5)  # bf16 kernel vs an fp32 reference on the same bf16 inputs
ok = (kernel != "sdpa" if cuda else kernel == "sdpa") and err_out <= tol and err_grad <= tol_grad and repeatable
ok = ok and (peak_gb < 1.5 if cuda else True)
print(f"{'PASS' if ok else 'FAIL'} attention: kernel={kernel} docs={lengths} H={H} d={dqk}/{dv} {dtype}: "
      f"rel err out {err_out:.2e} (tol {tol:g}) grads {err_grad:.2e} (tol {tol_grad:g}), deterministic backward repeatable={repeatable}, "
      f"fwd+bwd {ms_kernel:.1f} ms ({kernel}) vs {ms_sdpa:.1f} ms (per-document sdpa), "
      f"peak extra memory of one 8192-token document {peak_gb:.2f} GiB (limit 1.5)")
raise SystemExit(0 if ok else 1)
PY
}

check_grouped_mm() {
  "$PY" - <<'PY'
import os, time, warnings, torch
from hyper_parallel.models.common import grouped_mm as G
dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
E, S, I, O = (64, 16384, 2048, 1536) if cuda else (16, 4096, 256, 128)
gen = torch.Generator(device=dev).manual_seed(0)
counts = torch.distributions.Multinomial(S, torch.ones(E)).sample().to(dev, torch.int64)
x = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
w = torch.randn(E, O, I, device=dev, dtype=torch.bfloat16, generator=gen) / I**0.5
gy = torch.randn(S, O, device=dev, dtype=torch.bfloat16, generator=gen)

def fwd_bwd(impl, xx, ww):
    xx, ww = xx.clone().requires_grad_(), ww.clone().requires_grad_()
    y = G.grouped_linear(xx, ww, counts, impl)
    y.backward(gy.to(y.dtype))
    return y.detach(), xx.grad, ww.grad

def timed(impl, n=5):
    fwd_bwd(impl, x, w)
    if cuda: torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fwd_bwd(impl, x, w)
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

blocker = G.grouped_mm_blocker(x, w)
err = ms_grouped = float("nan")
if blocker is None:
    pairs = zip(fwd_bwd("grouped_mm", x, w), fwd_bwd("loop", x, w))
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)
    ms_grouped = timed("grouped_mm")
ms_loop = timed("loop")
# fp32 on CUDA has no grouped kernel: auto must say so (once); on CPU float64 stands in
G._warned.clear()
wide = torch.float32 if cuda else torch.float64
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        G.grouped_linear(x[:64].to(wide), w.to(wide), torch.tensor([64] + [0] * (E - 1), device=dev))
warned = [str(c.message) for c in caught if "per-expert loop" in str(c.message)]
ok = blocker is None and err <= 1e-2 and len(warned) == 1
print(f"{'PASS' if ok else 'FAIL'} grouped_mm: bf16 E={E} S={S} {I}->{O} kernel usable={blocker is None} ({blocker}), "
      f"rel err vs loop {err:.2e} (tol 1e-2), fwd+bwd {ms_grouped:.1f} ms grouped vs {ms_loop:.1f} ms loop; "
      f"{str(wide).removeprefix('torch.')} auto fallback warned {len(warned)}x (want 1)")
raise SystemExit(0 if ok else 1)
PY
}

check_loss() {
  "$PY" - <<'PY'
import os, torch, torch.nn.functional as F
from hyper_parallel.components import CrossEntropyLoss
dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
N, V = (8192, 171_000) if cuda else (2048, 32_000)
dtype = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)
logits = torch.randn(N, V, device=dev, dtype=dtype, generator=gen)
labels = torch.randint(0, V, (N,), device=dev, generator=gen)
labels[::7] = -100

def run(fn):
    x = logits.clone().requires_grad_()
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    loss = fn(x)
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return loss.item(), x.grad, peak

chunked, g_chunked, peak_chunked = run(lambda x: CrossEntropyLoss.Config().build()(x, labels))
plain, g_plain, peak_plain = run(lambda x: F.cross_entropy(x.float(), labels, ignore_index=-100))
d_loss = abs(chunked - plain)
d_grad = (g_chunked.float() - g_plain.float()).abs().max().item()
ok = d_loss <= 1e-5 and d_grad <= 1e-2 * g_plain.float().abs().max().item() and (peak_chunked < peak_plain / 2 if cuda else True)
print(f"{'PASS' if ok else 'FAIL'} chunked loss: {N} tokens x vocab {V} {dtype}: |dloss| {d_loss:.1e}, max |dgrad| {d_grad:.1e}, "
      f"peak extra memory {peak_chunked:.2f} GiB chunked vs {peak_plain:.2f} GiB F.cross_entropy(logits.float())")
raise SystemExit(0 if ok else 1)
PY
}

train() {  # train DIR ARGS...: the debug recipe, logs to DIR.log
  local dir=$1
  shift
  "${LAUNCH[@]}" --module glm_image_moe --config glm_image_moe_debug --dump_folder "$dir" \
    --metrics.log_freq 1 "$@" >"$dir.log" 2>&1
}

losses() { grep -o 'loss [0-9.]* | gnorm [0-9.]*' "$1" || true; }  # every step's loss and grad norm

check_bf16_step() {
  local dir=$WORK/bf16 rc=0
  train "$dir" --training.steps 3 --training.mixed_precision_param bfloat16 --checkpoint.no_enable || rc=$?
  local line
  line=$(grep -o 'done: .*' "$dir.log" || true)
  if [[ $rc -eq 0 && -n "$line" && "$line" != *nan* && "$line" != *inf* ]]; then
    echo "PASS bf16 FSDP step ($DEV): $line | $(grep -o 'tps [0-9]* | mfu [0-9.%]* | mem [0-9.]*GiB' "$dir.log" | tail -1)"
  else
    echo "FAIL bf16 FSDP step ($DEV): exit $rc; last log lines:"; tail -5 "$dir.log"; return 1
  fi
}

check_async_checkpoint() {
  local dir=$WORK/ckpt rc=0
  train "$dir" --training.steps 4 --checkpoint.enable --checkpoint.interval 2 --checkpoint.async_mode async || rc=$?
  local saved
  saved=$(ls "$dir/checkpoint" 2>/dev/null | grep -c '^step-[0-9]*$' || true)
  cp "$dir.log" "$dir.first.log"
  train "$dir" --training.steps 6 --checkpoint.enable --checkpoint.interval 2 --checkpoint.async_mode async || rc=$?
  if [[ $rc -eq 0 && $saved -ge 1 ]] && grep -q 'resumed from .*step-4' "$dir.log" && grep -q 'step *6/6' "$dir.log"; then
    echo "PASS async checkpoint: $saved complete checkpoints after 4 steps, resumed at step 4, ran to step 6"
  else
    echo "FAIL async checkpoint: exit $rc, $saved complete checkpoints; last log lines:"; tail -5 "$dir.log"; return 1
  fi
}

check_deterministic() {
  local rc=0
  train "$WORK/det1" --training.steps 3 --debug.deterministic --checkpoint.no_enable || rc=$?
  train "$WORK/det2" --training.steps 3 --debug.deterministic --checkpoint.no_enable || rc=$?
  local a b
  a=$(losses "$WORK/det1.log" | tr '\n' ' ')
  b=$(losses "$WORK/det2.log" | tr '\n' ' ')
  if [[ $rc -eq 0 && -n "$a" && "$a" == "$b" ]]; then
    echo "PASS deterministic: two runs, same losses: $a"
  else
    echo "FAIL deterministic: exit $rc; run 1: $a; run 2: $b"; tail -5 "$WORK/det2.log"; return 1
  fi
}

check_deltanet_kernels() {
  "$PY" - <<'PY'
import os, time, torch
from hyper_parallel.models.common import gated_delta_rule as gdr
from hyper_parallel.models.common.attention import AttentionMeta
dev = torch.device(os.environ["DEV"])
if gdr.fla_chunk_gated_delta_rule is None or gdr.causal_conv1d_fn is None or dev.type != "cuda":
    print(f"PASS (SKIP) deltanet kernels: fla installed {gdr.fla_chunk_gated_delta_rule is not None}, causal_conv1d "
          f"installed {gdr.causal_conv1d_fn is not None}, device {dev} (pip install 'hyper-parallel[gpu]' on CUDA)")
    raise SystemExit(0)
Hk, Hv, D, K, lengths = 8, 16, 128, 4, [3000, 2000, 1500, 1200, 492]  # 35B-A3B's DeltaNet heads, packed
T, G = sum(lengths), 2 * D + Hv // Hk * D
g = torch.Generator(device=dev).manual_seed(0)
qkv = torch.randn(1, T, Hk, G, device=dev, generator=g)
logdecay = -torch.rand(1, T, Hv, device=dev, generator=g)
beta = torch.rand(1, T, Hv, device=dev, generator=g)
w = torch.randn(Hk * G, K, device=dev, generator=g) * 0.3
grad = torch.randn(1, T, Hv, D, device=dev, generator=g) / T
meta = AttentionMeta(cu_seqlens=torch.tensor([0, *lengths], device=dev).cumsum(0).to(torch.int32))

def run(backend, dtype):
    rule = gdr.GatedDeltaRule.Config(backend=backend).build(head_k_dim=D, head_v_dim=D)
    xs = [qkv.to(dtype, copy=True).requires_grad_(), logdecay.clone().requires_grad_(),
          beta.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()]
    out = rule(xs[0], xs[1], xs[2], conv_weight=xs[3], meta=meta)
    out.backward(grad.to(dtype))
    return out.float(), [x.grad.float() for x in xs], rule.kernel(xs[0])

def timed(backend, dtype, n=5):
    run(backend, dtype); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        run(backend, dtype)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

out, grads, kernel = run("auto", torch.bfloat16)
ref, ref_grads, _ = run("torch", torch.float32)
rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
err_out, err_grad = rel(out, ref), max(rel(a, b) for a, b in zip(grads, ref_grads))
ok = kernel == "cuda_kernels" and err_out <= 3e-2 and err_grad <= 6e-2
print(f"{'PASS' if ok else 'FAIL'} deltanet kernels: kernel={kernel} docs={lengths} Hk={Hk} Hv={Hv} D={D}: bf16 kernels vs "
      f"fp32 torch path rel err out {err_out:.2e} (tol 3e-2) grads {err_grad:.2e} (tol 6e-2); fwd+bwd "
      f"{timed('auto', torch.bfloat16):.1f} ms (kernels, bf16) vs {timed('torch', torch.float32):.1f} ms (torch path, fp32)")
raise SystemExit(0 if ok else 1)
PY
}

run_check "A packed attention kernel" check_attention
run_check "B grouped matmul" check_grouped_mm
run_check "C chunked loss" check_loss
run_check "D bf16 FSDP step" check_bf16_step
run_check "E async checkpoint + resume" check_async_checkpoint
run_check "F deterministic runs" check_deterministic
run_check "G Gated DeltaNet CUDA kernels" check_deltanet_kernels

echo "== summary ($DEV)"
printf '%s\n' "${RESULTS[@]}"
exit "$FAILED"
