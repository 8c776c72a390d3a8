#!/bin/bash
# remat-curve (benches/RESULTS.md, "kiln's targets") in one command: kiln's gpt2-small bf16
# train step (device_bench's: B8 T1024, vocab 50304, AdamW) with no remat pass
# and at 50/33/25% of its activation memory (docs/memory.md defines the
# budget), one process per budget with the compile cache off, then JAX's same
# step with cuDNN attention, plain and with `jax.checkpoint` on every block.
# Prints a markdown table; writes $OUT/remat.json (every figure), table.md and
# the logs.
#
#   OUT=dir benches/device/remat.sh            (on the GPU; PJRT_DEVICE=CUDA)
#   REMAT_CONFIG=tiny REMAT_JAX=0 PJRT_DEVICE=cpu benches/device/remat.sh   (a check on the CPU plugin)
#
# REMAT_BIN: the remat_curve binary (default: beside this script, else
# target/release/examples/remat_curve); REMAT_BUDGETS: the budgets
# (default "none 50 33 25"; `hcP` is P% with kiln's host copies beside greedy,
# `--remat-strategy host-copy`: the issue's 4.6x point is `hc22`); REMAT_JAX=0 skips JAX; REMAT_JAX_IMPL: its attention
# (cudnn, or xla where there is no cuDNN); REMAT_JAX_ARGS: more jax_gpt.py flags.
# On a GPU the first budget's process writes XLA's autotuning results to
# $OUT/autotune.textproto and the later ones load them, so every budget runs a
# GEMM shape on the same cuBLAS kernel (apart, each process's autotuner picks
# its own, and the step time moves by 0.1-0.2 ms between processes:
# docs/memory-journal.md, "The LM head's running dw and block rows");
# REMAT_SHARE_AUTOTUNE=0 lets each process tune for itself.
D=$(cd "$(dirname "$0")" && pwd)
BIN=${REMAT_BIN:-$D/remat_curve}
[ -x "$BIN" ] || BIN=$D/../../target/release/examples/remat_curve
CONFIG=${REMAT_CONFIG:-gpt2-small}
export PJRT_DEVICE=${PJRT_DEVICE:-CUDA} KILN_CACHE=off PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/remat-curve}
mkdir -p "$OUT"
: > "$OUT/kiln.log"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
date -u
AT="$OUT/autotune.textproto"
rm -f "$AT"
share=${REMAT_SHARE_AUTOTUNE:-1}
case "$PJRT_DEVICE" in [Cc][Pp][Uu]) share=0 ;; esac
for b in ${REMAT_BUDGETS:-none 50 33 25}; do
  t0=$(date +%s)
  flags=$XLA_FLAGS
  if [ "$share" = 1 ]; then
    if [ -s "$AT" ]; then flags="$flags --xla_gpu_load_autotune_results_from=$AT"
    else flags="$flags --xla_gpu_dump_autotune_results_to=$AT"; fi
  fi
  copies=0; pct=$b
  case "$b" in hc*) copies=1; pct=${b#hc} ;; esac
  REMAT_HOST_COPIES=$copies XLA_FLAGS="$flags" timeout ${REMAT_TIMEOUT:-150} "$BIN" "$CONFIG" "$pct" 2>&1 | grep -v "^I1\|^W1\|ptxas\|^E0000\|^WARNING: All log" >> "$OUT/kiln.log"
  echo "kiln budget $b: rc ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s"
done
if [ "${REMAT_JAX:-1}" != 0 ]; then
  for v in plain checkpoint; do
    t0=$(date +%s)
    flag=; [ $v = checkpoint ] && flag=--checkpoint
    timeout ${REMAT_JAX_TIMEOUT:-120} python3 "$D/jax_gpt.py" ${REMAT_JAX_IMPL:-cudnn} time $flag --json "$OUT/jax_$v.json" $REMAT_JAX_ARGS 2>&1 \
      | grep -v "Warning\|^I1\|^W1\|^E0000" | tail -5 | tee "$OUT/jax_$v.log"
    echo "jax $v: rc ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s"
  done
fi
python3 "$D/remat_table.py" "$OUT/kiln.log" "$OUT"/jax_plain.json "$OUT"/jax_checkpoint.json --json "$OUT/remat.json" | tee "$OUT/table.md"
