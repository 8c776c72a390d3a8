#!/bin/bash
# Kernel traces (CUPTI, ktrace.c) of `kiln train gpt` gpt2-small under a mesh
# on two GPUs, one run per MODE:BUDGET (`fsdp:none`, `fsdp:25`), summed by
# stream with fsdp_streams.py: which collectives ran on the compute streams.
#   OUT=dir KILN_BIN=path TEXT=file benches/device/fsdp_ktrace.sh fsdp:none fsdp:25
set -u
D=$(cd "$(dirname "$0")" && pwd)
BIN=${KILN_BIN:-$D/kiln}
export PJRT_DEVICE=CUDA KILN_CACHE=off TF_CPP_MIN_LOG_LEVEL=2
mkdir -p "$OUT"
"$D/ktrace_build.sh"
for spec in "$@"; do
  IFS=: read -r shard b <<< "$spec"
  tag=${shard//=/}_$b
  args="--text $TEXT --config gpt2-small --amp bf16 --vocab 50304 --steps 20 --shard $shard --json"
  [ "$b" != none ] && args="$args --memory-limit $b%"
  CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/k_$tag.tsv \
    timeout 220 "$BIN" train gpt $args > "$OUT/$tag.json" 2> "$OUT/$tag.err"
  echo "== $tag: exit $?"
  python3 "$D/fsdp_streams.py" /tmp/k_$tag.tsv 5 | tee "$OUT/streams_$tag.txt"
done
