#!/bin/bash
# A/B runs of the remat-curve step (remat_curve gpt2-small BUDGET 10 3), one
# process per spec, with XLA's autotuning shared (the first process dumps it,
# the others load it), so that two builds or settings meet the same cuBLAS
# kernels. Prints one line per spec: step time (median of three runs of ten
# steps), the runs, XLA's temp bytes and the loss before and after the timed
# steps (about 34 steps on one batch: 8.88-8.95 when the step is right).
#
#   OUT=dir notebook/device/remat_ab.sh BIN:BUDGET:TRITON:LMHEAD[:dump[:EXTRA]] ...
#
# BIN: runs `remat_curve_BIN` beside this script; BUDGET: none or a percentage;
# TRITON: on, or off for `--xla_gpu_enable_triton_gemm=false`; LMHEAD: default,
# or MIB for KILN_LM_HEAD=blocks:MIB (197 gives gpt2-small 1024-row blocks, 99
# 512-row ones); dump: also print the optimized module's f32[50304,768] GEMMs
# and fusions (the LM head's running dw) and keep the module under $OUT;
# EXTRA: nocb turns XLA's command buffers off. T: seconds per process (120).
# Used for `benches/RESULTS.md`, "The LM head's dw accumulated in place".
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA KILN_CACHE=off TF_CPP_MIN_LOG_LEVEL=2
mkdir -p "$OUT"
AT=$OUT/autotune.textproto
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for spec in "$@"; do
  IFS=: read -r bin b tr lm dump extra <<< "$spec"
  if [ -s "$AT" ]; then flags="--xla_gpu_load_autotune_results_from=$AT"; else flags="--xla_gpu_dump_autotune_results_to=$AT"; fi
  [ "$tr" = off ] && flags="$flags --xla_gpu_enable_triton_gemm=false"
  [ "$extra" = nocb ] && flags="$flags --xla_gpu_enable_command_buffer="
  [ "$dump" = dump ] && { rm -rf /tmp/dump; flags="$flags --xla_dump_to=/tmp/dump --xla_dump_hlo_as_text"; }
  if [ "$lm" = default ]; then unset KILN_LM_HEAD; else export KILN_LM_HEAD=blocks:$lm; fi
  log="$OUT/$bin-$b-$tr-$lm$extra.log"
  t0=$(date +%s)
  XLA_FLAGS="$flags" timeout "${T:-120}" "$D/remat_curve_$bin" gpt2-small "$b" 10 3 > "$log" 2>&1
  rc=$?
  python3 - "$log" "$spec" "$rc" "$(( $(date +%s) - t0 ))" <<'PY'
import json, sys
f, spec, rc, s = sys.argv[1:]
r = [l for l in open(f) if l.startswith("RESULT ")]
if not r:
    print(spec, "rc", rc, s, "s: no result", open(f).read()[-600:])
    sys.exit()
d = json.loads(r[-1][7:])
x = d.get("xla", {})
print(f"{spec:28s} rc {rc} {s}s ms {d['ms']:.3f} runs {[round(v, 3) for v in d['runs_ms']]} "
      f"temp {x.get('temp_bytes')} loss {d['loss_first']:.5f}->{d['loss_last']:.5f}")
PY
  if [ "$dump" = dump ]; then
    f=$(ls -S /tmp/dump/*after_optimizations.txt | head -1)
    grep -E 'f32\[50304,768\]' "$f" | grep -E 'custom-call|fusion\(' | sed -E 's/metadata=\{[^}]*\}//' | cut -c1-420 | head -12
    gzip -c "$f" > "$OUT/hlo_$bin-$b.txt.gz"
  fi
done
