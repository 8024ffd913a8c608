#!/bin/bash
# BoB pass variants on the GPU (issue 4 notes): tile sweeps of the precise passes (both
# column-pass orientations: TileConfig.qmajor) with and without the hi + lo split of R and H,
# and the bf16 errors of each split setting.
#   bash scripts/bob_experiment.sh sweep    # tune.py per setting, N=16384 non-causal
#   bash scripts/bob_experiment.sh errors   # gpu_suite errors stage per setting
# SETTINGS: "COL_SPLIT ROW_SPLIT" pairs of the TTT_FLASH_BOB_*_SPLIT environment knobs.
set -u
OUTDIR=${OUT:-/tmp/bobexp}
T=/tmp/bobexp
mkdir -p "$T" "$OUTDIR"
SETTINGS=${SETTINGS:-"0 0|1 1"}
IFS='|' read -ra SET <<< "$SETTINGS"
for s in "${SET[@]}"; do
  read -r cs rs <<< "$s"
  tag="c${cs}r${rs}"
  export TTT_FLASH_BOB_COL_SPLIT=$cs TTT_FLASH_BOB_ROW_SPLIT=$rs
  case "$1" in
    sweep)
      python3 -m ttt_flash.kernels.tune --head-dim 64 --dtype bfloat16 --seq-len ${N:-16384} \
        --heads 12 --kinds "${KINDS:-bob_direct,bob_col}" --out "$T/tune_$tag.json" 2>&1 \
        | grep -E "^(bob|bwd|compiled)" | sed "s/^/$tag /"
      ;;
    errors)
      python3 scripts/gpu_suite.py --stages errors --out "$T/err_$tag" 2>&1 | grep -E "bar|worst" | sed "s/^/$tag /"
      ;;
    *)
      echo "usage: bash scripts/bob_experiment.sh sweep|errors" >&2; exit 2
      ;;
  esac
done
tar czf "$OUTDIR/bobexp_$1.tgz" -C "$T" . 2>/dev/null
