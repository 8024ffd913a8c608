#!/usr/bin/env bash
# One device call after the kernel, forward-mode and context-parallel changes:
#   pytest -m gpu (kernels, tangent kernel, torch.compile)
#   the forward-mode benchmark (tangent forward, jvp-then-backward, GPT HVP memory)
#   with two GPUs: the context-parallel chain, causal (skipped on one GPU)
#   first chain call in a fresh process with an empty Triton cache
# With two GPUs the tests and the forward-mode benchmark run side by side, one GPU each.
# Usage (device machine, repo root): bash scripts/gpu_check.sh   (results under $OUT)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
second=$((ngpu > 1 ? 1 : 0))
t0=$(date +%s)
(CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_jvp_gpu.py \
   tests/test_compile_gpu.py >"$OUT/pytest.txt" 2>&1; echo "rc=$?" >>"$OUT/pytest.txt") &
[ "$ngpu" -gt 1 ] || wait
(CUDA_VISIBLE_DEVICES=$second python3 -m ttt_flash.bench --jvp --seq-lens 16384,65536 --hvp --out "$OUT/jvp" \
   >"$OUT/jvp.txt" 2>&1; echo "rc=$?" >>"$OUT/jvp.txt") &
wait
t1=$(date +%s)
if [ "$ngpu" -gt 1 ]; then
  python3 -m ttt_flash.bench --context-parallel 2 --causal --seq-lens 16384,262144 --out "$OUT/cp" \
    >"$OUT/cp.txt" 2>&1; echo "rc=$?" >>"$OUT/cp.txt"
else
  echo "one GPU: context-parallel bench skipped" >"$OUT/cp.txt"
fi
t2=$(date +%s)
CUDA_VISIBLE_DEVICES=0 python3 scripts/gpu_suite.py --stages startup --out "$OUT/startup" >"$OUT/startup.txt" 2>&1
t3=$(date +%s)
echo "== pytest ($((t1 - t0)) s)"; grep -E "passed|failed|error|rc=" "$OUT/pytest.txt" | tail -8
echo "== jvp"; tail -25 "$OUT/jvp.txt"
echo "== context parallel, causal ($((t2 - t1)) s)"; tail -12 "$OUT/cp.txt"
echo "== startup ($((t3 - t2)) s)"; tail -4 "$OUT/startup.txt"
