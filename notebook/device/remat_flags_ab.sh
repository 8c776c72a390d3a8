#!/bin/bash
# A/B runs of the remat-curve step (remat_curve gpt2-small BUDGET 10 3) under
# XLA flags, one process per spec, XLA's autotuning shared through
# $OUT/autotune.textproto as in remat_ab.sh. Prints one line per spec: step
# time (median of three runs of ten steps), XLA's temp bytes, the loss before
# and after the timed steps.
#
#   OUT=dir notebook/device/remat_flags_ab.sh BIN:BUDGET:FLAGS ...
#
# BIN: runs `remat_curve_BIN` beside this script; BUDGET: none or a
# percentage; FLAGS: XLA flags, commas for spaces (empty for none). Used for
# `benches/RESULTS.md`, "The LM head in two passes".
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA KILN_CACHE=off TF_CPP_MIN_LOG_LEVEL=2
AT=$OUT/autotune.textproto
for spec in "$@"; do
  IFS=: read -r bin b fl <<< "$spec"
  if [ -s "$AT" ]; then flags="--xla_gpu_load_autotune_results_from=$AT"; else flags="--xla_gpu_dump_autotune_results_to=$AT"; fi
  flags="$flags ${fl//,/ }"
  log="$OUT/$bin-$b-$(echo $fl | tr -cd 'a-z0-9' | cut -c1-40).log"
  XLA_FLAGS="$flags" timeout 150 "$D/remat_curve_$bin" gpt2-small "$b" 10 3 > "$log" 2>&1
  python3 - "$log" "$spec" <<'PY'
import json, sys
f, spec = sys.argv[1:]
r = [l for l in open(f) if l.startswith("RESULT ")]
if not r:
    print(spec, "no result", open(f).read()[-400:]); sys.exit()
d = json.loads(r[-1][7:]); x = d.get("xla", {})
print(f"{spec:70s} ms {d['ms']:.3f} temp {x.get('temp_bytes')} loss {d['loss_first']:.4f}->{d['loss_last']:.4f}", flush=True)
PY
done
