#!/bin/bash
# Node 1 SIGKILLed mid-run without the launcher: node 0 must end by itself with 75.
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln; R=/tmp/mh; mkdir -p $R
export PJRT_DEVICE=CUDA KILN_CACHE=off NCCL_NVLS_ENABLE=0 TF_CPP_MIN_LOG_LEVEL=2 KILN_STARTUP_TIMEOUT_MS=60000
now() { date +%s.%N; }
LONG="train mlp --data $D/fmnist --hidden 4096,4096 --batch 4096 --epochs 5000 --json"
P=$((21000 + RANDOM % 2000))
export KILN_NUM_NODES=2 KILN_COORDINATOR=127.0.0.1:$P KILN_PEER_TIMEOUT_MS=4000 KILN_RUN_ID=kill
KILN_NODE_ID=0 KILN_LOCAL_DEVICES=0 $K $LONG > /dev/null 2> $R/kill0.err & P0=$!
KILN_NODE_ID=1 KILN_LOCAL_DEVICES=1 $K $LONG > /dev/null 2> $R/kill1.err & P1=$!
sleep 14; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
kill -9 $P1; t0=$(now)
for i in $(seq 400); do kill -0 $P0 2>/dev/null || break; sleep 0.1; done
if kill -0 $P0 2>/dev/null; then echo "node 0 still running 40 s after the kill: FAIL"; kill -9 $P0; fi
wait $P0; rc=$?; t1=$(now)
echo "node 0 exited rc=$rc (75 = lost peer) $(python3 -c "print('%.2f s after node 1 was killed' % ($t1-$t0))")"
grep -v "^I1\|^W1\|ptxas" $R/kill0.err | tail -4
