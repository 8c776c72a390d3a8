#!/bin/bash
# Final harness run on the H100: kiln's workloads, then the peers in two parts
# (so a timeout in the gpt peers keeps the mlp/chain/jax figures), one table.
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u
mkdir -p $OUT/p1 $OUT/p2
timeout 230 $D/device_bench 2>&1 | grep -v "^I1\|^W1\|ptxas" | tail -40 | tee $OUT/kiln.log
OUT=$OUT/p1 timeout 150 python3 $D/peers.py mlp chain jax 2>&1 | grep -v Warning | tail -20
OUT=$OUT/p2 timeout 170 python3 $D/peers.py gpt 2>&1 | grep -v Warning | tail -10
python3 - <<PY
import json,os
r=[]
for p in ("$OUT/p1/baseline.json","$OUT/p2/baseline.json"):
    try: r+=json.load(open(p))
    except Exception as e: print("missing",p,e)
json.dump(r,open("$OUT/baseline.json","w"),indent=1)
PY
python3 $D/table.py $OUT/kiln.json $OUT/baseline.json | tee $OUT/table.md
