#!/bin/bash
# Second H100 call of issue 13's init work: the init program with scalar
# inputs (kernel reuse), cold and from the disk cache; tiny-GPT losses of
# host init twice and device init once (is the GPU run deterministic?).
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
echo "== gpt2-small set-up, no disk cache"; KILN_CACHE=off $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
for i in 1 2; do echo "== gpt2-small set-up, disk cache run $i"; KILN_CACHE_DIR=/tmp/kc $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"; done
echo "== tiny gpt, 20 steps: host, host, device"
for init in host host device; do
  KILN_CACHE=off KILN_INIT=$init $K train gpt --config tiny --text $D/text.txt --steps 20 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; v=json.load(sys.stdin); print(v['init'], 'setup_ms %.1f' % v['setup_ms'], 'losses', v['losses'][0], v['losses'][1], v['losses'][-1])"
done
