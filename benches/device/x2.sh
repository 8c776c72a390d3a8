#!/bin/bash
# On nvidia-h200-x2: issue 14's checks (multihost.sh) and issue 15's 1- and 2-GPU
# data-parallel figures (gpt2-small bf16 and mlp-b4096, batch per replica fixed).
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln
export PJRT_DEVICE=CUDA KILN_CACHE=off NCCL_NVLS_ENABLE=0 TF_CPP_MIN_LOG_LEVEL=2
summ() { python3 -c "
import json,sys
l=[x for x in sys.stdin.read().splitlines() if x.startswith('{')]
d=json.loads(l[-1]) if l else {}
print('$1', {k: d.get(k) for k in ('steps','step_ms_median','compile_seconds','final_loss')})"; }
B4K="train mlp --data $D/fmnist --hidden 4096,4096 --batch 4096 --max-steps 60 --lr 1e-3 --json"
GPT="train gpt --text README.md --config gpt2-small --vocab 50304 --amp bf16 --max-grad-norm 1 --steps 12 --json"
for n in 1 2; do
  echo "== dp $n GPU(s)"
  GPU_NUM_DEVICES=$n timeout 80 $K $B4K 2>/dev/null | summ "mlp-b4096 x$n"
  GPU_NUM_DEVICES=$n timeout 100 $K $GPT 2>/dev/null | summ "gpt2-small x$n"
done
bash $D/multihost.sh quick
