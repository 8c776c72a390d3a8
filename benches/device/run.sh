#!/usr/bin/env bash
# The device harness: kiln's workloads and its peers' in one call on the GPU
# machine, then one ratio table.
#
# Usage: run.sh BIN_DIR
#   BIN_DIR holds the prebuilt `device_bench` (cargo build --release -p
#   kiln-benches --example device_bench; target/release/examples/device_bench),
#   `peers.py` (../shared/bench/peers.py) and `table.py` (this folder).
# Results go to $OUT (default /tmp/kiln-device): kiln.json, baseline.json,
# the logs and table.md.
# Knobs: KILN_WORK / PEERS_WORK (workload subsets: "mlp chain gpt compile" /
# "mlp chain jax gpt"), KILN_TIMEOUT_S / PEERS_TIMEOUT_S.
set -u
BIN=$(cd "$1" && pwd)
export OUT=${OUT:-/tmp/kiln-device}
mkdir -p "$OUT"
export PJRT_DEVICE=${PJRT_DEVICE:-CUDA} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
date -u
# shellcheck disable=SC2086
timeout "${KILN_TIMEOUT_S:-300}" "$BIN/device_bench" ${KILN_WORK:-} 2>&1 | tee "$OUT/kiln.log"
# shellcheck disable=SC2086
timeout "${PEERS_TIMEOUT_S:-420}" python3 "$BIN/peers.py" ${PEERS_WORK:-} 2>&1 | grep -v Warning | tee "$OUT/peers.log"
python3 "$BIN/table.py" "$OUT/kiln.json" "$OUT/baseline.json" | tee "$OUT/table.md"
