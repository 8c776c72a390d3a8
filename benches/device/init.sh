#!/bin/bash
# On-device init and CUDA client hygiene on one GPU (issue 13 items 3 and 4).
# Carried with the stripped `kiln` and `init_setup` binaries and a text.
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
echo "== gpu"; nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
echo "== parameter set-up (init_setup, no disk cache)"
KILN_CACHE=off $D/init_setup tiny gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== tiny gpt, 20 steps, host vs device init: setup_ms and losses"
for init in host device; do
  KILN_CACHE=off KILN_INIT=$init $K train gpt --config tiny --text $D/text.txt --steps 20 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; v=json.load(sys.stdin); print(v['init'], 'setup_ms %.1f' % v['setup_ms'], 'compiles', v['compiles'], 'losses[0,-1]', v['losses'][0], v['losses'][-1])"
done
echo "== memory the plugin takes (nvidia-smi, 7 s into a tiny run)"
LONG="train gpt --config tiny --text $D/text.txt --steps 100000"
for f in "" 0.2 0.5; do
  KILN_CACHE=off KILN_GPU_MEMORY_FRACTION=$f GPU_NUM_DEVICES=1 $K $LONG >/dev/null 2>/tmp/err$f & P=$!
  sleep 7; echo "fraction '${f:-unset}': $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
  kill $P; wait $P 2>/dev/null; grep -v "^[IW]1" /tmp/err$f | tail -2
done
KILN_CACHE=off KILN_GPU_PREALLOCATE=false $K $LONG >/dev/null 2>/tmp/errp & P=$!
sleep 7; echo "preallocate false: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
kill $P; wait $P 2>/dev/null; grep -v "^[IW]1" /tmp/errp | tail -2
echo "== a bad fraction"; KILN_GPU_MEMORY_FRACTION=1.5 $K train gpt --config tiny --text $D/text.txt --steps 1 2>&1 | tail -2
echo "== GPU_NUM_DEVICES=1: devices"; GPU_NUM_DEVICES=1 $K devices --json 2>&1 | tail -c 700
