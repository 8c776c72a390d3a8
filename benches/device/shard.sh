#!/bin/bash
# Issue 13 on nvidia-h200-x2: gpt2-small bf16 on two GPUs under data parallel
# (replicas), FSDP (parameters + AdamW state split over data=2) and tensor
# parallel (model=2), the batch per data-parallel rank fixed at 8 x 1024.
# Per mode: median step time, tokens/s (global batch x seq / median step),
# XLA's per-device plan of the train step (arguments = parameters + AdamW
# state + batch; temp; XLA's peak), and nvidia-smi's peak per GPU (sampled
# every 0.2 s; it includes whatever the CUDA plugin preallocates).
#
# Run from the repository root with the kiln binary next to this script:
#   bash .devcarry/shard/shard.sh           # CUDA, two GPUs
#   bash benches/device/shard.sh cpu        # the CPU analogue (tiny GPT, 2 CPU devices)
D=$(cd "$(dirname "$0")" && pwd)
K=${KILN_BIN:-$D/kiln}
[ -x "$K" ] || K=$(cd "$D/../.." && pwd)/target/release/kiln
MODE=${1:-cuda}
export KILN_CACHE=off TF_CPP_MIN_LOG_LEVEL=2 NCCL_NVLS_ENABLE=0 KILN_GPU_PREALLOCATE=false
if [ "$MODE" = cpu ]; then
  export PJRT_DEVICE=CPU KILN_CPU_DEVICES=2
  ARGS="train gpt --text README.md --steps 12 --json"
  LIMIT=120
else
  export PJRT_DEVICE=CUDA GPU_NUM_DEVICES=2
  ARGS="train gpt --text README.md --config gpt2-small --vocab 50304 --amp bf16 --steps 20 --json"
  LIMIT=150
fi
echo "kiln: $K ($MODE)"
for SPEC in dp fsdp tp=2; do
  SMI=""
  if [ "$MODE" != cpu ] && command -v nvidia-smi >/dev/null; then
    SMI=$(mktemp)
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 >"$SMI" 2>/dev/null &
    SMI_PID=$!
  fi
  OUT=$(timeout $LIMIT "$K" $ARGS --shard "$SPEC" 2>/tmp/shard_$$.err)
  RC=$?
  if [ -n "$SMI" ]; then kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; fi
  echo "$OUT" | python3 -c "
import json, sys
spec, rc, smi = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = [l for l in sys.stdin.read().splitlines() if l.startswith('{')]
if rc != 0 or not lines:
    print(f'{spec:5s} FAILED rc={rc}'); sys.exit(0)
d = json.loads(lines[-1])
m = d.get('device_memory') or {}
mib = lambda b: f'{b / 2**20:.1f} MiB' if b is not None else '?'
peaks = {}
if smi:
    for row in open(smi):
        try:
            i, used = [int(x) for x in row.split(',')]
            peaks[i] = max(peaks.get(i, 0), used)
        except ValueError:
            pass
print(f\"{spec:5s} mesh={d.get('mesh') or 'replicas x2'} batch={d['global_batch']}x{d['seq']} \"
      f\"step {d['step_ms_median']:.1f} ms  {d['tokens_per_second']:.0f} tok/s  loss {d['first_loss']:.3f}->{d['final_loss']:.3f}  \"
      f\"xla/device: args {mib(m.get('argument_bytes'))} temp {mib(m.get('temp_bytes'))} held {mib(m.get('held_bytes'))}  \"
      + ('nvidia-smi peak ' + ', '.join(f'gpu{i} {v} MiB' for i, v in sorted(peaks.items())) if peaks else ''))
" "$SPEC" "$RC" "$SMI"
  [ $RC -ne 0 ] && tail -5 /tmp/shard_$$.err
  [ -n "$SMI" ] && rm -f "$SMI"
done
rm -f /tmp/shard_$$.err
