#!/bin/bash
# Issue 13, on-device init set-up (helper `setup`), second H100 call: the
# memory pool reserved on a thread from the client's start, the optimizer
# state made by the init program, the init program's shifts as
# shift_right_logical (by inputs / by constants / the old division).
# Run from a folder holding the stripped release binaries (kiln, init_setup;
# kiln_main: the main build to compare) and a README.md to train on.
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cp $D/README.md /tmp/text.md
KEYS="'client_ms','setup_ms','setup_breakdown','first_step_ms','compiles','disk_hits','compile_seconds','first_loss','final_loss','step_ms_median','init'"
run() { # label binary steps env...
  local label=$1 bin=$2 steps=$3; shift 3
  echo "== $label ($(date -u +%T))"
  env "$@" timeout 150 $D/$bin train gpt --text /tmp/text.md --config gpt2-small --vocab 50304 --amp bf16 --steps $steps --json > /tmp/o.json 2> /tmp/o.err; echo rc=$?
  python3 -c "
import json; j=json.load(open('/tmp/o.json')); b=j.get('setup_breakdown') or {}
print(json.dumps({k:j.get(k) for k in ($KEYS)}))
print('client+setup ms', round(j['client_ms']+j['setup_ms'],1))" || tail -5 /tmp/o.err
}
for s in input divide input; do
  echo "== init_setup, shifts $s, no disk cache ($(date -u +%T))"
  KILN_INIT_SHIFTS=$s KILN_CACHE=off timeout 100 $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
done
echo "== init_setup, shifts constant, no disk cache ($(date -u +%T))"
KILN_INIT_SHIFTS=constant KILN_CACHE=off timeout 60 $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== element-wise against host init, shifts input ($(date -u +%T))"
KILN_CACHE=off timeout 100 $D/init_setup --compare gpt2-small 2>&1 | grep -v "^[IW]1"
run "device cold 1" kiln 0 KILN_CACHE=off KILN_INIT=device
run "device cold 2" kiln 0 KILN_CACHE=off KILN_INIT=device
run "device fill, 3 steps" kiln 3 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "device hit, 3 steps" kiln 3 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "device hit 2" kiln 0 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "device hit 3" kiln 0 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "device hit, preallocate off, 3 steps" kiln 3 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device KILN_GPU_PREALLOCATE=false
run "device hit, memory fraction 0.25" kiln 0 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device KILN_GPU_MEMORY_FRACTION=0.25
run "host init" kiln 0 KILN_CACHE=off KILN_INIT=host
echo "== end ($(date -u +%T))"
