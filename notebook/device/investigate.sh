#!/usr/bin/env bash
# mlp-b4096: kiln's and JAX's optimized HLO (XLA dumps) and per-kernel GPU
# times (Nsight Compute, one metric) of the same training step, side by side.
# Usage: investigate.sh BIN_DIR  (BIN_DIR as for benches/device/run.sh, plus
# benches/device/jax_mlp.py and kernels.py)
set -u
BIN=$(cd "$1" && pwd)
export OUT=${OUT:-/tmp/kiln-device}
mkdir -p "$OUT" /tmp/dump-kiln /tmp/dump-jax
export PJRT_DEVICE=${PJRT_DEVICE:-CUDA} XLA_PYTHON_CLIENT_PREALLOCATE=false
XLA_FLAGS="--xla_dump_to=/tmp/dump-kiln --xla_dump_hlo_as_text" "$BIN/device_bench" profile-mlp4096 3
XLA_FLAGS="--xla_dump_to=/tmp/dump-jax --xla_dump_hlo_as_text" python3 "$BIN/jax_mlp.py" 4096 3
tar czf "$OUT/dumps.tgz" -C /tmp dump-kiln dump-jax
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in kiln jax; do
  if [ $who = kiln ]; then cmd=("$BIN/device_bench" profile-mlp4096 30); else cmd=(python3 "$BIN/jax_mlp.py" 4096 30); fi
  timeout 150 "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    "${cmd[@]}" > "$OUT/ncu-$who.csv" 2> "$OUT/ncu-$who.err"
  echo "ncu $who: rc $? $(wc -l < "$OUT/ncu-$who.csv") lines"
done
python3 "$BIN/kernels.py" "$OUT/ncu-kiln.csv" "$OUT/ncu-jax.csv" | tee "$OUT/kernels.md"
