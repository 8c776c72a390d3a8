#!/bin/bash
# Second call of the gpt2-small investigation (after gpt_profile.sh): kiln with
# the optimizer on, its optimized HLO and saved step graph, then its step's
# kernels under Nsight Compute (JAX under ncu segfaulted in the first call;
# its HLO from that call is the comparison). Usage: gpt_profile2.sh BIN_DIR
# (device_bench; beside this script, benches/device/step_kernels.py)
set -u
D=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "${1:-$D}" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 KILN_CACHE=off
LOG=$OUT/summary.log
mkdir -p /tmp/atc /tmp/dk /tmp/ncu /tmp/sg
ATC="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc"
say() { echo "== $* ($(date -u +%T))" | tee -a $LOG; }
quiet() { grep -v "^I1\|^W1\|ptxas\|Warning\|^E1" | tail -${1:-4} | tee -a $LOG; }
say "kiln, optimizer on (default passes)"
KILN_SAVE_GRAPHS=/tmp/sg XLA_FLAGS="$ATC --xla_dump_to=/tmp/dk --xla_dump_hlo_as_text" timeout 100 $BIN/device_bench gpt 2>&1 | quiet 3
cd /tmp && find dk -name '*after_optimizations.txt' -o -name '*memory-usage-report*' | tar czf $OUT/dumps.tgz -T - sg
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
say "ncu kiln"
XLA_FLAGS="$ATC" timeout 110 "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
  $BIN/device_bench profile-gpt 3 > /tmp/ncu/kiln.csv 2> /tmp/ncu/kiln.err
echo "rc $? $(grep -c '^"' /tmp/ncu/kiln.csv) rows; $(tail -3 /tmp/ncu/kiln.err | tr '\n' ' ')" | tee -a $LOG
python3 $D/step_kernels.py kiln=/tmp/ncu/kiln.csv > $OUT/kernels.md 2>&1
cat $OUT/kernels.md
gzip -c /tmp/ncu/kiln.csv > $OUT/ncu-kiln.csv.gz
