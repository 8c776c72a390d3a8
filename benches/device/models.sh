#!/usr/bin/env bash
# Issue 59's table: the four model styles of `kiln_models` on the GPU, kiln in
# both spellings beside JAX and torch.compile on the same plain code.
#
# Usage: models.sh BIN_DIR [kiln|peers|all]
#   BIN_DIR holds the prebuilt `models_bench` (cargo build --release -p
#   kiln-benches --example models_bench) and `models_peers.py`, `models_table.py`
#   (this folder). `kiln` runs kiln's 8 runs, `peers` the 8 peer runs (JAX and
#   PyTorch), `all` both; results append to $OUT/models.jsonl, and the table
#   of everything there goes to $OUT/models.md.
# Knobs: MODELS (default "llama gpt2 bert t5"), ITERS (default 10), REPS (3),
# SPELLINGS (default "plain builtin"), PEERS (default "jax torch"; "hf" runs
# transformers' own models under torch.compile).
set -u
BIN=$(cd "$1" && pwd)
WHAT=${2:-all}
export OUT=${OUT:-/tmp/kiln-device}
mkdir -p "$OUT"
export PJRT_DEVICE=${PJRT_DEVICE:-CUDA} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
MODELS=${MODELS:-llama gpt2 bert t5}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for m in $MODELS; do
  if [ "$WHAT" != peers ]; then
    for s in ${SPELLINGS:-plain builtin}; do
      timeout 300 "$BIN/models_bench" "$m" "$s" "${ITERS:-10}" "${REPS:-3}" 2>&1 | tee -a "$OUT/kiln_$m.log" | grep RESULT | sed 's/^RESULT //' >> "$OUT/models.jsonl"
    done
  fi
  if [ "$WHAT" != kiln ]; then
    for f in ${PEERS:-jax torch}; do
      timeout 300 python3 "$BIN/models_peers.py" "$f" "$m" $(( ${ITERS:-10} * ${REPS:-3} )) 2>&1 | grep -v Warning | tee -a "$OUT/peers_$m.log" | grep RESULT | sed 's/^RESULT //' >> "$OUT/models.jsonl"
    done
  fi
done
python3 "$BIN/models_table.py" "$OUT/models.jsonl" | tee "$OUT/models.md"
