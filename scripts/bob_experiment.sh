#!/bin/bash
# BoB pass variants on the GPU: tile sweeps of the precise passes (both column-pass
# orientations: TileConfig.qmajor) with and without the hi + lo split of R and H
# (attn_bob(split_row=..., split_col=...)).
#   bash scripts/bob_experiment.sh          # tune.py per setting, N=16384 non-causal
# SETTINGS: "ROW_SPLIT,COL_SPLIT" pairs (0/1), separated by '|'. The bf16 errors of the split
# are printed by `pytest -m gpu -s tests/test_kernels_gpu.py -k gpt2_shape`.
set -u
OUTDIR=${OUT:-/tmp/bobexp}
T=/tmp/bobexp
mkdir -p "$T" "$OUTDIR"
SETTINGS=${SETTINGS:-"0,0|1,1"}
IFS='|' read -ra SET <<< "$SETTINGS"
for s in "${SET[@]}"; do
  tag="split${s/,/}"
  python3 -m ttt_flash.kernels.tune --head-dim 64 --dtype bfloat16 --seq-len ${N:-16384} \
    --heads 12 --kinds "${KINDS:-bob_direct,bob_col}" --bob-split "$s" --out "$T/tune_$tag.json" 2>&1 \
    | grep -E "^(bob|bwd|compiled)" | sed "s/^/$tag /"
done
tar czf "$OUTDIR/bobexp.tgz" -C "$T" . 2>/dev/null
