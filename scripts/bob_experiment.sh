#!/bin/bash
# BoB pass variants on the GPU (issue 4 notes): tile sweeps of the precise passes with and
# without the hi + lo split and in both column-pass orientations, bf16 errors of each setting.
#   bash scripts/bob_experiment.sh sweep    # tune.py per setting, N=16384 non-causal
#   bash scripts/bob_experiment.sh errors   # gpu_suite errors stage per setting
# Settings: "COL_SPLIT ROW_SPLIT COL_QMAJOR" environment knobs of ttt_flash.kernels.bob.
set -u
OUTDIR=${OUT:-/tmp/bobexp}
T=/tmp/bobexp
mkdir -p "$T" "$OUTDIR"
SETTINGS=${SETTINGS:-"1 1 0|0 0 0|0 0 1|1 1 1"}
IFS='|' read -ra SET <<< "$SETTINGS"
for s in "${SET[@]}"; do
  read -r cs rs qm <<< "$s"
  tag="c${cs}r${rs}q${qm}"
  export TTT_FLASH_BOB_COL_SPLIT=$cs TTT_FLASH_BOB_ROW_SPLIT=$rs TTT_FLASH_BOB_COL_QMAJOR=$qm
  case "$1" in
    sweep)
      kinds=${KINDS:-bob_direct,bob_col}
      [ "$qm" = 1 ] && kinds=bob_col
      python3 -m ttt_flash.kernels.tune --head-dim 64 --dtype bfloat16 --seq-len ${N:-16384} \
        --heads 12 --kinds "$kinds" --out "$T/tune_$tag.json" 2>&1 | grep -E "^(bob|compiled)" | sed "s/^/$tag /"
      ;;
    errors)
      python3 scripts/gpu_suite.py --stages errors --out "$T/err_$tag" 2>&1 | grep -E "bar|worst" | sed "s/^/$tag /"
      ;;
  esac
done
tar czf "$OUTDIR/bobexp_$1.tgz" -C "$T" . 2>/dev/null
