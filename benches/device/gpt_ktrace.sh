#!/bin/bash
# per-kernel times of kiln's and JAX's gpt2-small step through a
# CUPTI injection library (ncu segfaults under XLA), plus both optimized HLOs.
# Usage: gpt_ktrace.sh, from a folder holding it with device_bench, jax_gpt.py,
# ktrace_build.sh, ktrace.c and ktrace.py.
set -u
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 KILN_CACHE=off XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/summary.log
say() { echo "== $* ($(date -u +%T))" | tee -a $LOG; }
quiet() { grep -v "^I1\|^W1\|ptxas\|Warning\|^E1" | tail -${1:-4} | tee -a $LOG; }
say start
"$D/ktrace_build.sh" 2>&1 | tee -a $LOG
mkdir -p /tmp/dk /tmp/dj
say "kiln profile-gpt 8 traced"
CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/kiln.tsv XLA_FLAGS="--xla_dump_to=/tmp/dk --xla_dump_hlo_as_text" timeout 120 $D/device_bench profile-gpt 8 2>&1 | quiet 3
python3 $D/ktrace.py kiln /tmp/kiln.tsv 3 > $OUT/kiln-kernels.md 2>&1; head -14 $OUT/kiln-kernels.md | tee -a $LOG
say "jax cudnn profile 8 traced"
CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/jax.tsv XLA_FLAGS="--xla_dump_to=/tmp/dj --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" timeout 120 python3 $D/jax_gpt.py cudnn profile 8 2>&1 | quiet 3
python3 $D/ktrace.py jax /tmp/jax.tsv 3 > $OUT/jax-kernels.md 2>&1; head -14 $OUT/jax-kernels.md | tee -a $LOG
say packing
cd /tmp && (find dk dj -name '*after_optimizations.txt' -o -name '*memory-usage-report*' -o -name '*thunk_sequence*'; echo kiln.tsv; echo jax.tsv) | tar czf $OUT/dumps.tgz -T -
ls -la $OUT | tee -a $LOG
say end
