#!/bin/bash
# Issue 13, on-device init set-up (helper `setup`), first H100 call:
# attribute the CLI's gpt2-small set-up (setup_breakdown), old (main) vs new
# binary, cold and from the disk cache; the first program's cost on a fresh
# client (init_setup); element-wise compare with host init.
# Run from a folder holding the stripped release binaries (kiln, init_setup;
# kiln_main: the main build to compare) and a README.md to train on.
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cp $D/README.md /tmp/text.md 2>/dev/null || cp README.md /tmp/text.md
KEYS="'client_ms','setup_ms','setup_breakdown','first_step_ms','compiles','disk_hits','compile_seconds','first_loss','final_loss','step_ms_median','init'"
run() { # label binary steps env...
  local label=$1 bin=$2 steps=$3; shift 3
  echo "== $label ($(date -u +%T))"
  env "$@" timeout 150 $D/$bin train gpt --text /tmp/text.md --config gpt2-small --vocab 50304 --amp bf16 --steps $steps --json > /tmp/o.json 2> /tmp/o.err; echo rc=$?
  python3 -c "
import json; j=json.load(open('/tmp/o.json')); print(json.dumps({k:j.get(k) for k in ($KEYS)}))" || tail -5 /tmp/o.err
  cp /tmp/o.json "$OUT/$(echo $label | tr ' ,=/' '____').json" 2>/dev/null
}
echo "== init_setup, no disk cache ($(date -u +%T))"
KILN_CACHE=off $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
run "new device cold 1" kiln 0 KILN_CACHE=off KILN_INIT=device
run "new device cold 2" kiln 0 KILN_CACHE=off KILN_INIT=device
run "main device cold" kiln_main 0 KILN_CACHE=off KILN_INIT=device
run "new host" kiln 0 KILN_CACHE=off KILN_INIT=host
run "new device fill steps3" kiln 3 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "new device hit steps3" kiln 3 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "new device hit 2" kiln 0 KILN_CACHE_DIR=/tmp/kc KILN_INIT=device
run "main device fill steps3" kiln_main 3 KILN_CACHE_DIR=/tmp/kcm KILN_INIT=device
run "main device hit steps3" kiln_main 3 KILN_CACHE_DIR=/tmp/kcm KILN_INIT=device
echo "== element-wise against host init ($(date -u +%T))"
KILN_CACHE_DIR=/tmp/kc $D/init_setup --compare gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== end ($(date -u +%T))"
