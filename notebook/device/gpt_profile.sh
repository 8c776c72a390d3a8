#!/bin/bash
# gpt2-small bf16 on the H100, one call: kiln with the optimizer on (default
# passes), off (KILN_PASSES=none) and without the rewrite pass
# (KILN_PASSES=cse,dce,fusion); JAX with cuDNN attention beside it; both
# programs' optimized HLO (XLA dumps); then both steps' kernels timed by Nsight
# Compute (one metric, clocks left alone) and summed by kind (step_kernels.py).
# The XLA per-fusion autotune cache is filled by the timed runs so that the
# profiled runs reuse the same kernel choices instead of re-autotuning under
# the profiler. Usage: gpt_profile.sh BIN_DIR (device_bench; beside this script,
# benches/device/jax_gpt.py and step_kernels.py); writes $OUT/summary.log, kernels.md, dumps.tgz.
set -u
D=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "${1:-$D}" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2 KILN_CACHE=off
LOG=$OUT/summary.log
mkdir -p /tmp/atc /tmp/dk /tmp/dj /tmp/ncu /tmp/sg
ATC="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc"
say() { echo "== $* ($(date -u +%T))" | tee -a $LOG; }
quiet() { grep -v "^I1\|^W1\|ptxas\|Warning\|^E1" | tail -${1:-4} | tee -a $LOG; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $LOG
say "kiln, optimizer on (default passes)"
KILN_SAVE_GRAPHS=/tmp/sg XLA_FLAGS="$ATC --xla_dump_to=/tmp/dk --xla_dump_hlo_as_text" timeout 120 $BIN/device_bench gpt > /tmp/on.log 2>&1
rc=$?; quiet < /tmp/on.log; echo "rc $rc" | tee -a $LOG
if [ $rc -ne 0 ] && grep -qi "unknown flag\|xla_gpu_per_fusion" /tmp/on.log; then
  ATC=""; say "autotune cache flag refused: without it"
  XLA_FLAGS="--xla_dump_to=/tmp/dk --xla_dump_hlo_as_text" timeout 120 $BIN/device_bench gpt 2>&1 | quiet
fi
for p in none cse,dce,fusion; do
  say "kiln, KILN_PASSES=$p"
  KILN_PASSES=$p XLA_FLAGS="$ATC" timeout 100 $BIN/device_bench gpt 2>&1 | quiet 2
done
say "JAX, cuDNN attention"
XLA_FLAGS="$ATC --xla_dump_to=/tmp/dj --xla_dump_hlo_as_text" timeout 120 python3 $D/jax_gpt.py cudnn time 2>&1 | quiet 3
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in kiln jax; do
  say "ncu $who"
  if [ $who = kiln ]; then cmd=($BIN/device_bench profile-gpt 8); else cmd=(python3 $D/jax_gpt.py cudnn profile 8); fi
  XLA_FLAGS="$ATC" timeout 150 "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    "${cmd[@]}" > /tmp/ncu/$who.csv 2> /tmp/ncu/$who.err
  echo "rc $? $(grep -c '^"' /tmp/ncu/$who.csv) rows; $(tail -2 /tmp/ncu/$who.err | tr '\n' ' ')" | tee -a $LOG
done
python3 $D/step_kernels.py kiln=/tmp/ncu/kiln.csv jax-cudnn=/tmp/ncu/jax.csv > $OUT/kernels.md 2>&1
cat $OUT/kernels.md
cd /tmp && find dk dj -name '*after_optimizations.txt' -o -name '*memory-usage-report*' | tar czf $OUT/dumps.tgz -T - ncu sg
ls -la $OUT
