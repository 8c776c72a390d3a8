#!/bin/bash
# Issue 13: should kiln's CUDA client preallocate? The plugin's BFC allocator
# reserves 75% of the GPU at the first allocation (~1 s on an H100, most of
# gpt2-small's set-up); KILN_GPU_PREALLOCATE=false takes memory as it is
# needed. This runs gpt2-small bf16 for PREALLOC_STEPS steps (default 300)
# from a filled disk cache, preallocation on and off alternated twice, and
# prints per run: client_ms, setup_ms, first_step_ms, step median, XLA's plan
# of the train step and nvidia-smi's peak. The question it answers: are the
# step time and the step's memory the same without preallocation over a long
# run (fragmentation)?
#
#   bash notebook/device/prealloc.sh          (kiln beside this script, else target/release/kiln)
#   PJRT_DEVICE=cpu PREALLOC_CONFIG=tiny PREALLOC_STEPS=20 bash notebook/device/prealloc.sh   (a dry run)
D=$(cd "$(dirname "$0")" && pwd)
K=${KILN_BIN:-$D/kiln}
[ -x "$K" ] || K=$(cd "$D/../.." && pwd)/target/release/kiln
export PJRT_DEVICE=${PJRT_DEVICE:-CUDA} TF_CPP_MIN_LOG_LEVEL=2 KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-prealloc-cache}
CONFIG=${PREALLOC_CONFIG:-gpt2-small}
ARGS="train gpt --text $D/../../README.md --config $CONFIG --steps ${PREALLOC_STEPS:-300} --json"
[ -f "$D/../../README.md" ] || ARGS="train gpt --text $D/README.md --config $CONFIG --steps ${PREALLOC_STEPS:-300} --json"
[ "$CONFIG" = gpt2-small ] && ARGS="$ARGS --vocab 50304 --amp bf16"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "kiln: $K; $ARGS"
one() { # label, then the value of KILN_GPU_PREALLOCATE
  local SMI="" SMI_PID=""
  if command -v nvidia-smi >/dev/null; then
    SMI=$(mktemp)
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$SMI" 2>/dev/null &
    SMI_PID=$!
  fi
  OUTJ=$(KILN_GPU_PREALLOCATE=$2 timeout 300 "$K" $ARGS 2>/tmp/prealloc_$$.err)
  RC=$?
  [ -n "$SMI_PID" ] && { kill "$SMI_PID"; wait "$SMI_PID"; } 2>/dev/null
  echo "$OUTJ" | python3 -c "
import json, sys
label, rc, smi = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = [l for l in sys.stdin.read().splitlines() if l.startswith('{')]
if rc != 0 or not lines:
    print(f'{label}: FAILED rc={rc}'); sys.exit(0)
d = json.loads(lines[-1]); m = d.get('device_memory') or {}
peak = max((int(x) for x in open(smi) if x.strip().isdigit()), default=None) if smi else None
print(f\"{label}: client {d['client_ms']:.0f} ms, setup {d['setup_ms']:.0f} ms, first step {d.get('first_step_ms', 0):.0f} ms, \"
      f\"step median {d['step_ms_median']:.2f} ms, loss {d['first_loss']:.4f}->{d['final_loss']:.4f}, \"
      f\"XLA temp {m.get('temp_bytes')} B held {m.get('held_bytes')} B, nvidia-smi peak {peak} MiB\")
" "$1" "$RC" "$SMI"
  [ $RC -ne 0 ] && tail -5 /tmp/prealloc_$$.err
  [ -n "$SMI" ] && rm -f "$SMI"
}
one "fill the cache (preallocate default)" ""
for round in 1 2; do
  one "round $round, preallocate default" ""
  one "round $round, preallocate false" false
done
