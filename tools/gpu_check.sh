#!/usr/bin/env bash
# One-shot check on a GPU machine with no network, a preinstalled CUDA torch and Python 3.12 (written for
# one H200), in under 8 minutes. Stages, each timed:
#   0. megatron-core: used if it imports (0.16.x), else installed offline from the wheel in .gpu-wheels/ into
#      /tmp/gspo_site (pip --no-index --no-deps --target; nothing touches the preinstalled packages),
#   1. builds gspo_mcore._C in place with the CUDA kernels (this GPU's arch only),
#   2. runs tests/ops/test_cuda_ops.py (fused LM head included), then every other test marked `gpu`,
#   3. benchmarks token_logprobs at T=16384, V=151936 bf16 against one streaming read of the logits and
#      against eager torch, then the fused LM head (tools/bench_fused_head.py: T=16384, H=1024, V=151936,
#      bf16) against eager (matmul + log_softmax) and today's path (matmul + token_logprobs), time and peak memory,
#   4. a 20-step tiny GSPO job (examples/tiny) on the GPU, 1 rank, the in-process engine, the local layer
#      spec when Transformer Engine is absent, loss.fused_lm_head=true (GPU_CHECK_FUSED=0: the logits path).
#
# What it needs besides this repository (prepare once on a machine with network, in the repo root:
# `make gpu-wheels`, then copy the git-ignored .gpu-wheels/ folder to the GPU machine with the repository):
#   .gpu-wheels/megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
# megatron-core needs only torch, numpy and packaging, and the tiny job pyyaml, safetensors, tokenizers,
# transformers, tqdm, psutil, pytest for the tests: the GPU machine must have these installed. The compiled
# extension (*.so, git-ignored) is built there, not copied. Run it from the repo root: `bash tools/gpu_check.sh`
# (about 8 minutes on one H200).
#
# Usage: tools/gpu_check.sh [--dry-run]
#   --dry-run  on a machine without a GPU: checks the wheel, skips the build (uses the extension already
#              built), runs the CUDA tests (they skip), the benchmarks at tiny sizes on the CPU and a 2-step
#              tiny job on the CPU: every stage's command is exercised except the CUDA code itself.
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default: this GPU's arch), BENCH_T / BENCH_V
#              (default 16384 / 151936), GPU_CHECK_FUSED (default 1), GPU_CHECK_OUT (default /tmp/gspo_gpu_check),
#              GPU_CHECK_LIMIT_SCALE (stage time limits x this; default 1, 5 with --dry-run),
#              GPU_CHECK_WHEELS (the folder holding the megatron-core wheel; default .gpu-wheels).
# Exit status: non-zero if a stage failed (stages after a failed build are not run; the others all run).
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
# a dry run on a (shared, slow) CPU gets longer stage limits
LIMIT_SCALE="${GPU_CHECK_LIMIT_SCALE:-$(( DRY ? 5 : 1 ))}"
OUTDIR="${GPU_CHECK_OUT:-/tmp/gspo_gpu_check}"
mkdir -p "$OUTDIR"
WHEELS="${GPU_CHECK_WHEELS:-.gpu-wheels}"
MCORE_VERSION=0.16.1
status=0
t_all=$(date +%s)

say() { echo "[gpu_check] $*"; }
# stage NAME TIMEOUT_S CMD...: runs CMD (a program or an exported function) with a time limit, prints its
# duration and rc; a failure sets status.
stage() {
  local name=$1 limit=$(( $2 * LIMIT_SCALE )) t0 rc=0
  shift 2
  echo "=== [gpu_check] $name (limit ${limit}s)"
  t0=$(date +%s)
  timeout "$limit" bash -c '"$@"' stage "$@" || rc=$?
  say "$name: rc=$rc in $(( $(date +%s) - t0 )) s$([[ $rc -eq 124 ]] && echo ' (TIMED OUT)')"
  [[ $rc -eq 0 ]] || status=1
  return 0
}

say "host: $(hostname)  date: $(date -u +%FT%TZ)  dry_run=$DRY"
if [[ $DRY -eq 0 ]]; then
  nvidia-smi || say "nvidia-smi failed"
fi
"$PY" - <<'PYEOF'
import sys, torch
print(f"[gpu_check] python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
PYEOF
if [[ $DRY -eq 0 ]] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "no CUDA device visible to torch: run with --dry-run on a machine without a GPU"
  exit 2
fi

# ---- 0. megatron-core ----------------------------------------------------------------------------------
echo "=== [gpu_check] megatron-core"
mcore_version() { "$PY" -c 'import megatron.core as m; print(m.__version__)' 2>/dev/null || true; }
have=$(mcore_version)
if [[ "$have" == 0.16.* ]]; then
  say "megatron-core $have already importable"
else
  shopt -s nullglob
  wheels=("$WHEELS"/megatron_core-"$MCORE_VERSION"-*.whl)
  shopt -u nullglob
  if [[ ${#wheels[@]} -ne 1 ]]; then
    say "megatron-core is not importable (found '${have:-none}') and $WHEELS holds ${#wheels[@]} megatron_core-$MCORE_VERSION wheel(s), not 1:"
    say "run 'make gpu-wheels' in the repo root where there is network, and copy $WHEELS/ to this machine"
    exit 1
  fi
  pyver=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  if [[ "${wheels[0]}" != *"-$pyver-"* ]]; then
    say "the wheel ${wheels[0]} is not for this Python ($pyver)"
    exit 1
  fi
  if [[ $DRY -eq 1 ]]; then
    say "dry run: would install ${wheels[0]} into /tmp/gspo_site"
  else
    t0=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gspo_site \
      "${wheels[@]}"
    export PYTHONPATH="/tmp/gspo_site${PYTHONPATH:+:$PYTHONPATH}"
    have=$(mcore_version)
    [[ "$have" == "$MCORE_VERSION" ]] || { say "megatron-core still does not import after installing the wheel"; exit 1; }
    say "megatron-core $have installed from $WHEELS in $(( $(date +%s) - t0 )) s"
  fi
fi
"$PY" -c 'import transformer_engine' 2>/dev/null && say "Transformer Engine imports" \
  || say "Transformer Engine absent: the learner uses Megatron-Core's local layer spec"

# ---- 1. build ----------------------------------------------------------------------------------------
if [[ $DRY -eq 1 ]]; then
  say "dry run: build skipped (using the extension already in gspo_mcore/)"
else
  if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")' \
                            2>/dev/null || echo "9.0")"
  fi
  export TORCH_CUDA_ARCH_LIST
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  command -v nvcc >/dev/null && nvcc --version | tail -n 1 || say "nvcc not on PATH"
  rc=0
  build() { "$PY" setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1; }
  export PY OUTDIR
  export -f build
  stage "build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)" 300 build
  if [[ $status -ne 0 ]]; then
    say "BUILD FAILED (last 40 lines of $OUTDIR/build.log):"
    tail -n 40 "$OUTDIR/build.log"
    exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, gspo_mcore._C as C; print("[gpu_check] built_with_cuda =", C.built_with_cuda, " cpu_isa =", C.cpu_isa(), " module:", C.__file__)'
if [[ $DRY -eq 0 ]]; then
  "$PY" -c 'import gspo_mcore._C as C; assert C.built_with_cuda, "the extension was built without CUDA"'
fi

# ---- 2. tests ----------------------------------------------------------------------------------------
stage "pytest tests/ops/test_cuda_ops.py" 180 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_ops.py
other_gpu_tests() {
  local rc=0
  "$PY" -m pytest -q -p no:cacheprovider -m gpu --ignore=tests/ops/test_cuda_ops.py tests || rc=$?
  [[ $rc -eq 5 ]] && { say "(no other gpu-marked tests)"; rc=0; }
  return $rc
}
export PY OUTDIR
export -f say other_gpu_tests
stage "pytest -m gpu (the other GPU tests)" 120 other_gpu_tests

# ---- 3. benchmarks -----------------------------------------------------------------------------------
if [[ $DRY -eq 1 ]]; then
  stage "benchmark fused LM head (CPU, tiny)" 120 "$PY" tools/bench_fused_head.py --device cpu --tokens 64 \
    --hidden 32 --vocab 1000 --dtype fp32 bf16 --chunk 256 --single-pass --json "$OUTDIR/bench_fused_head.json"
else
  stage "benchmark token_logprobs" 120 "$PY" tools/gpu_bench_logprobs.py
  stage "benchmark fused LM head" 150 "$PY" tools/bench_fused_head.py --device cuda --tokens "${BENCH_T:-16384}" \
    --hidden 1024 --vocab "${BENCH_V:-151936}" --dtype bf16 fp32 --chunk 8192 --reps 5 --warmup 2 \
    --json "$OUTDIR/bench_fused_head.json"
fi

# ---- 4. the tiny GSPO job ----------------------------------------------------------------------------
RUN="$OUTDIR/tiny"
rm -rf "$RUN"
steps=20
[[ $DRY -eq 1 ]] && steps=2
tiny_job() {
  "$PY" -m examples.tiny.prepare --out "$RUN" >/dev/null
  local fused=true
  [[ "${GPU_CHECK_FUSED:-1}" == 0 ]] && fused=false
  OMP_NUM_THREADS=4 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m gspo_mcore.train \
    --config examples/tiny/config.yaml steps=$steps log.output_dir="$RUN" model.hf_dir="$RUN/model" \
    "data.paths=[$RUN/prompts.jsonl]" loss.fused_lm_head=$fused checkpoint.dir="$RUN/checkpoints" \
    >"$OUTDIR/tiny.log" 2>&1 || { tail -n 40 "$OUTDIR/tiny.log"; return 1; }
  "$PY" - "$RUN/metrics.jsonl" "$steps" <<'PYEOF'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
want = int(sys.argv[2])
keys = [k for k in ("step", "loss", "reward_mean", "entropy", "time_step_s") if k in rows[-1]]
for r in rows[:: max(1, len(rows) // 5)] + rows[-1:]:
    print("[tiny]", {k: r[k] for k in keys})
losses = [r["loss"] for r in rows if "loss" in r]
ok = len(rows) == want and all(math.isfinite(x) for x in losses)
print(f"[tiny] {len(rows)} steps logged (want {want}), losses finite: {ok}")
sys.exit(0 if ok else 1)
PYEOF
}
export RUN steps
export -f tiny_job
stage "tiny GSPO job, $steps steps, fused_lm_head=${GPU_CHECK_FUSED:-1}" 240 tiny_job

# ---- 5. context parallelism with Transformer Engine (THD-packed, CP=2) -------------------------------
# UNTESTED until it has run on a host with >= 2 GPUs and Transformer Engine: one GSPO rollout batch of the toy
# model on 1 GPU (the reference) and with CP=2 on 2 GPUs (THD micro-batches split per sequence, TE's CP
# attention); losses, gradient norms and forward-only log-probs must agree.
echo "=== [gpu_check] context parallelism (Transformer Engine, CP=2)"
ngpu="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if "$PY" -c "import megatron.core, transformer_engine" 2>/dev/null && [[ "$ngpu" -ge 2 ]]; then
  rc=0
  cpdir="$(mktemp -d)"
  (
    cd tests/learner
    export PYTHONPATH="$PWD/..:$PWD/../..${PYTHONPATH:+:$PYTHONPATH}"
    timeout 300 "$PY" invariance_worker.py --ref "$cpdir" --out "$cpdir/one.jsonl" \
      --cases '[{"name": "ref-dense-gspo", "model": "dense", "variant": "gspo", "save": true}]'
    timeout 300 "$PY" -m torch.distributed.run --nproc_per_node 2 invariance_worker.py --ref "$cpdir" \
      --out "$cpdir/cp2.jsonl" --cases '[{"name": "cp2-gspo", "model": "dense", "variant": "gspo", "cp": 2}]'
  ) || rc=$?
  if [[ $rc -eq 0 ]]; then
    "$PY" - "$cpdir/cp2.jsonl" <<'EOF' || rc=$?
import json, math, sys
r = json.loads(open(sys.argv[1]).readline())
close = lambda a, b, tol: all(math.isclose(x, y, rel_tol=tol, abs_tol=1e-6) for x, y in zip(a, b))
ok = close(r["losses"], r["ref_losses"], 1e-4) and close(r["grad_norms"], r["ref_grad_norms"], 1e-3)
ok = ok and r["logp_diff"] < 1e-3
print(f"[gpu_check] CP2 losses {r['losses']} vs {r['ref_losses']}, grad norms {r['grad_norms']} vs "
      f"{r['ref_grad_norms']}, logp diff {r['logp_diff']:.3g}, param diff {r['param_diff']:.3g}: {'OK' if ok else 'FAILED'}")
raise SystemExit(0 if ok else 1)
EOF
  fi
  echo "[gpu_check] CP rc=$rc"
  [[ $rc -eq 0 ]] || status=1
else
  echo "[gpu_check] CP skipped: needs megatron.core, transformer_engine and >= 2 GPUs (found $ngpu)"
fi

say "DONE status=$status in $(( $(date +%s) - t_all )) s"
exit $status
