#!/bin/bash
# Kernel times of the remat-curve step (remat_curve gpt2-small) at several
# budgets, through the CUPTI injection library ktrace.c, with XLA's optimized
# HLO of each program: where a plan's extra step time goes.
#   OUT=dir REMAT_BIN=path REMAT_BUDGETS="none 60 50" benches/device/remat_ktrace.sh
set -u
D=$(cd "$(dirname "$0")" && pwd)
BIN=${REMAT_BIN:-$D/remat_curve}
export PJRT_DEVICE=CUDA KILN_CACHE=off TF_CPP_MIN_LOG_LEVEL=2
mkdir -p "$OUT"
"$D/ktrace_build.sh"
for b in ${REMAT_BUDGETS:-none 60 50}; do
  rm -rf /tmp/d_$b
  t0=$(date +%s)
  CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/k_$b.tsv \
    XLA_FLAGS="--xla_dump_to=/tmp/d_$b --xla_dump_hlo_as_text" \
    timeout 200 "$BIN" gpt2-small "$b" 10 3 2>&1 | grep -v "^I1\|^W1\|ptxas\|^E0000" | grep RESULT > "$OUT/result_$b.txt"
  echo "budget $b: $(( $(date +%s) - t0 )) s"; cat "$OUT/result_$b.txt" | cut -c1-200
  python3 $D/ktrace.py "$b" /tmp/k_$b.tsv 5 > "$OUT/kernels_$b.md"
  head -14 "$OUT/kernels_$b.md"
  gzip -c /tmp/k_$b.tsv > "$OUT/k_$b.tsv.gz"
  f=$(ls -S /tmp/d_$b/*after_optimizations.txt | head -1); gzip -c "$f" > "$OUT/hlo_$b.txt.gz"
  f=$(ls -S /tmp/d_$b/*buffer-assignment.txt 2>/dev/null | head -1); [ -n "$f" ] && gzip -c "$f" > "$OUT/buf_$b.txt.gz"
done
ls -la "$OUT"
