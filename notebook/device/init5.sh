#!/bin/bash
# Fifth H100 call of issue 13's init work: the init program with the shift
# divisors as program inputs (not constants), cold, both forms; the disk-cache
# hit; every parameter against host init on the GPU.
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
for form in flat flat per-parameter; do
  echo "== gpt2-small set-up, $form, no disk cache"
  KILN_CACHE=off KILN_INIT_FORM=$form $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
done
echo "== fill and hit the disk cache"; KILN_CACHE_DIR=/tmp/kc $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
KILN_CACHE_DIR=/tmp/kc $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== element-wise against host init"; KILN_CACHE_DIR=/tmp/kc $D/init_setup --compare gpt2-small 2>&1 | grep -v "^[IW]1"
