#!/bin/bash
# Second H100 call (issue 11): the flag read started at enqueue (new) against
# the read at completion (old), checks on and off; the CLI's step times.
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
filt() { grep -v "^I1\|^W1\|ptxas\|^kiln on\|^20[0-9][0-9]-"; }
date -u
for v in "device_bench_old 1" "device_bench 1" "device_bench 0" "device_bench_old 1"; do
  set -- $v; echo "-- $1 KILN_DEVICE_CHECKS=$2"
  KILN_DEVICE_CHECKS=$2 timeout 60 "$D/$1" mlp64 2>&1 | filt
done
for b in 4096 64; do
  echo "-- kiln train mlp --hidden 4096,4096 --batch $b --max-steps 60"
  timeout 60 "$D/kiln" train mlp --data "$D/fmnist" --hidden 4096,4096 --batch $b --max-steps 60 --json 2>&1 | filt | python3 -c "
import json,sys
for l in sys.stdin:
    if l.startswith('{'):
        d=json.loads(l); print({k:d[k] for k in ('step_ms_median','first_step_ms','train_seconds','steps','compile_seconds','test_accuracy')})
    else: print(l.rstrip()[:300])"
done
date -u
