#!/bin/bash
# Issue 14 (multihost) device checks, for nvidia-h200-x2, run from the repo root:
#   bash benches/device/multihost.sh [quick]   (a release kiln and fmnist/ beside it)
# 1. MLP: 2 processes x 1 GPU vs 1 process x 2 GPUs, same seed and global batch:
#    every step's loss and the checkpoint (written by node 0 only) compared.
# 2. Step time, 2 processes vs 1 process x 2 GPUs: mlp-b4096 and gpt2-small bf16.
# 3. Failures: node 1 SIGKILLed mid-run -> node 0 exits on its own (watchdog,
#    KILN_PEER_TIMEOUT_MS=4000, bound 4 s + 1 s beat + 5 s exit grace), and the
#    same under `kiln launch` (the launcher stops the rest).
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln; R=/tmp/mh; mkdir -p $R
export PJRT_DEVICE=CUDA KILN_CACHE=off NCCL_NVLS_ENABLE=0 TF_CPP_MIN_LOG_LEVEL=2 KILN_STARTUP_TIMEOUT_MS=60000
q() { grep -v "^I1\|^W1\|^E1\|^$\|ptxas\|WARNING: All log" | tail -${1:-8}; }
now() { date +%s.%N; }
# Key figures from the last JSON line of stdin.
summ() { python3 -c "
import json,sys
l=[x for x in sys.stdin.read().splitlines() if x.startswith('{')]
d=json.loads(l[-1]) if l else {}
print('$1', {k: d.get(k) for k in ('steps','step_ms_median','first_step_ms','compile_seconds','final_loss','first_loss')})"; }
nvidia-smi -L
timeout 60 $K devices --json | head -c 600; echo

MLP="train mlp --data $D/fmnist --batch 2048 --epochs 1 --seed 3 --json"
echo "== mlp 1 process x 2 GPUs"
GPU_NUM_DEVICES=2 timeout 60 $K $MLP --checkpoint $R/ck1.st > $R/mlp1.json 2> $R/mlp1.err; echo "rc=$?"; q 4 < $R/mlp1.err
echo "== mlp 2 processes x 1 GPU (kiln launch)"
KILN_LOG=kiln_runtime=info timeout 60 $K launch --nodes 2 -- sh -c "exec $K $MLP --checkpoint $R/ck2.st > $R/mlp2-\$KILN_NODE_ID.json" 2> $R/mlp2.err; echo "rc=$?"
grep -a "arrived\|client created\|launch\|rror" $R/mlp2.err | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300 | head -12
python3 - "$R" <<'PY'
import json, sys, numpy as np
r = sys.argv[1]
def last(p):
    try: return json.loads(open(p).read().strip().splitlines()[-1])
    except Exception as e: return {"error": str(e)}
a, b0, b1 = last(f"{r}/mlp1.json"), last(f"{r}/mlp2-0.json"), last(f"{r}/mlp2-1.json")
la, lb0, lb1 = (np.array(x.get("losses", [])) for x in (a, b0, b1))
print("steps", len(la), len(lb0), len(lb1), "acc", a.get("test_accuracy"), b0.get("test_accuracy"), b1.get("test_accuracy"))
if len(la) and len(la) == len(lb0) == len(lb1):
    print("max |loss diff| 1x2 vs node0: %.3e, vs node1: %.3e, first 10 steps: %.3e" % (
        abs(la - lb0).max(), abs(la - lb1).max(), abs(la[:10] - lb0[:10]).max()))
    print("losses 1x2:", la[:3], "...", la[-1], " node0:", lb0[:3], "...", lb0[-1])
try:
    from safetensors.numpy import load_file
    c1, c2 = load_file(f"{r}/ck1.st"), load_file(f"{r}/ck2.st")
    d = max(float(np.abs(c1[k].astype(np.float64) - c2[k].astype(np.float64)).max()) for k in c1 if c1[k].dtype.kind == "f")
    print("checkpoint: %d tensors each, same names %s, max |param diff| %.3e" % (len(c1), sorted(c1) == sorted(c2), d))
except Exception as e:
    print("checkpoint compare failed:", e)
PY

B4K="train mlp --data $D/fmnist --hidden 4096,4096 --batch 4096 --max-steps 60 --lr 1e-3 --json"
GPT="train gpt --text README.md --config gpt2-small --vocab 50304 --amp bf16 --max-grad-norm 1 --steps 8 --json"
# `multihost.sh quick` skips the timings (section 2).
[ "$1" = quick ] && TIMED="" || TIMED="B4K GPT"
for w in $TIMED; do
  echo "== $w 1 process x 2 GPUs"
  GPU_NUM_DEVICES=2 timeout 100 $K ${!w} 2> $R/$w-1.err | summ 1x2; q 3 < $R/$w-1.err
  echo "== $w 2 processes x 1 GPU"
  timeout 100 $K launch --nodes 2 -- sh -c "exec $K ${!w} > $R/$w-2-\$KILN_NODE_ID.json" 2> $R/$w-2.err; echo "rc=$?"; q 3 < $R/$w-2.err
  summ node0 < $R/$w-2-0.json; summ node1 < $R/$w-2-1.json
done

LONG="train mlp --data $D/fmnist --hidden 4096,4096 --batch 4096 --epochs 5000 --json"
echo "== kill node 1 mid-run, no launcher: node 0 serves the store and must end by itself"
P=$((21000 + RANDOM % 2000))
( export KILN_NUM_NODES=2 KILN_COORDINATOR=127.0.0.1:$P KILN_PEER_TIMEOUT_MS=4000 KILN_RUN_ID=kill
  # No `timeout` wrapper: $! must be kiln itself, or the kill misses it.
  KILN_NODE_ID=0 KILN_LOCAL_DEVICES=0 $K $LONG > /dev/null 2> $R/kill0.err & P0=$!
  KILN_NODE_ID=1 KILN_LOCAL_DEVICES=1 $K $LONG > /dev/null 2> $R/kill1.err & P1=$!
  sleep 14; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
  kill -9 $P1; t0=$(now)
  for i in $(seq 400); do kill -0 $P0 2>/dev/null || break; sleep 0.1; done
  if kill -0 $P0 2>/dev/null; then echo "node 0 still running 40 s after the kill: FAIL"; kill -9 $P0; fi
  wait $P0; rc=$?; t1=$(now)
  echo "node 0 exited rc=$rc (75 = lost peer) $(python3 -c "print('%.2f s after node 1 was killed' % ($t1-$t0))")"
  q 4 < $R/kill0.err )
echo "== kill node 1 mid-run under kiln launch"
( timeout 60 $K launch --nodes 2 --grace-ms 2000 -- sh -c "echo \$\$ > $R/pid\$KILN_NODE_ID; exec $K $LONG > /dev/null" 2> $R/launchkill.err & L=$!
  sleep 14; kill -9 $(cat $R/pid1); t0=$(now); wait $L; rc=$?; t1=$(now)
  echo "launcher exited rc=$rc $(python3 -c "print('%.2f s after node 1 was killed' % ($t1-$t0))")"
  q 4 < $R/launchkill.err )
[ -n "$OUT" ] && cp $R/mlp1.json $R/mlp2-0.json $R/mlp2.err $R/kill0.err $R/launchkill.err $R/GPT-2.err "$OUT"/ 2>/dev/null; true
