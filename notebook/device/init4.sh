#!/bin/bash
# Fourth H100 call of issue 13's init work: where the init program's cold
# compile goes outside XLA's GPU compiler phases (which sum to ~0.3 s of
# 13 s): every XLA log line at VLOG 1 with its timestamp, the largest gaps
# between consecutive lines; and two XLA flags that remove work the GPU
# compile may do (autotuning, command buffers).
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
for form in flat per-parameter; do
  echo "== gpt2-small, $form, VLOG 1, no disk cache"
  KILN_CACHE=off KILN_INIT_FORM=$form TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=1 timeout 150 $D/init_setup gpt2-small > /tmp/vlog_$form.txt 2>&1
  grep "params\|trivial" /tmp/vlog_$form.txt; wc -l < /tmp/vlog_$form.txt
  python3 $D/gaps.py /tmp/vlog_$form.txt 10 | tee $OUT/gaps_$form.txt
  gzip -c /tmp/vlog_$form.txt > $OUT/vlog_$form.txt.gz
done
for flags in "--xla_gpu_autotune_level=0" "--xla_gpu_enable_command_buffer="; do
  echo "== gpt2-small, flat, XLA_FLAGS=$flags, no disk cache"
  KILN_CACHE=off XLA_FLAGS="$flags" timeout 100 $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
done
