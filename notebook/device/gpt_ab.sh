#!/bin/bash
# gpt2-small on the H100 with the attn branch (new) vs main (old)
# in one call: harness figure (captured async + waited-for phases), the
# passes off, JAX cuDNN beside it; per-kernel times of the new step (CUPTI
# injection), its XLA temporaries, and cuDNN vs plain attention numerics.
# Usage: gpt_ab.sh, from a folder holding it with device_bench_new,
# device_bench_old, kiln, attention-test (testsuite's `attention` test
# binary), and benches/device/'s jax_gpt.py, ktrace.c and ktrace.py.
set -u
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 KILN_CACHE=off XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/summary.log
say() { echo "== $* ($(date -u +%T))" | tee -a $LOG; }
quiet() { grep -v "^I1\|^W1\|ptxas\|Warning\|^E1" | tail -${1:-4} | tee -a $LOG; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $LOG
say "attention parity (cudnn vs plain, on the device)"
timeout 90 $D/attention-test --nocapture --test-threads 1 2>&1 | grep -v "^I1\|^W1\|ptxas" | tail -14 | tee -a $LOG
for v in new old new; do
  say "device_bench gpt ($v)"
  OUT=/tmp timeout 100 $D/device_bench_$v gpt 2>&1 | quiet 2
done
say "device_bench gpt (new, KILN_PASSES=none)"
KILN_PASSES=none OUT=/tmp timeout 100 $D/device_bench_new gpt 2>&1 | quiet 2
say "JAX cudnn"
timeout 100 python3 $D/jax_gpt.py cudnn time 2>&1 | quiet 2
say "ktrace build"
SP=$(python3 -c "import site;print(site.getsitepackages()[0])")
INC=/usr/local/cuda-13.0/targets/x86_64-linux/include
LIB=$SP/triton/backends/nvidia/lib/cupti
[ -f $INC/cupti_activity.h ] || INC=$(dirname "$(find /usr/local /opt $SP -name cupti_activity.h 2>/dev/null | grep -v deprecated | head -1)")
[ -f $LIB/libcupti.so ] || LIB=$(dirname "$(find $SP /usr/local /opt -name "libcupti.so*" 2>/dev/null | head -1)")
KV=$(grep -o 'CUpti_ActivityKernel[0-9]*' $INC/cupti_activity.h | sort -V | tail -1)
gcc -shared -fPIC -O2 -DKREC=$KV -I$INC $D/ktrace.c -o /tmp/ktrace.so -L$LIB -l:$(ls $LIB | grep '^libcupti.so' | head -1) -Wl,-rpath,$LIB 2>&1 | tail -3 | tee -a $LOG
say "new profile-gpt 8 traced, XLA dump, saved graph"
mkdir -p /tmp/dk /tmp/sg
CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/new.tsv KILN_SAVE_GRAPHS=/tmp/sg XLA_FLAGS="--xla_dump_to=/tmp/dk --xla_dump_hlo_as_text" timeout 100 $D/device_bench_new profile-gpt 8 2>&1 | quiet 2
python3 $D/ktrace.py new /tmp/new.tsv 3 > $OUT/new-kernels.md 2>&1; head -14 $OUT/new-kernels.md | tee -a $LOG
say "kiln compile of the saved step (XLA temporaries)"
f=$(ls -S /tmp/sg/*.kiln 2>/dev/null | head -1); echo "graph $f" | tee -a $LOG
[ -n "$f" ] && timeout 100 $D/kiln compile $f 2>&1 | grep -v "^I1\|^W1\|ptxas" | grep -i "temp\|memory\|nodes\|fused\|composite" | head -12 | tee -a $LOG
cd /tmp && (find dk -name '*after_optimizations.txt' -o -name '*memory-usage-report*'; echo new.tsv) | tar czf $OUT/dumps.tgz -T -
say end
