#!/bin/bash
# The host-path follow-up on the H100 (issue 11, 2026-11-23): the spread of
# mlp-b64 between calls, per-kernel GPU times of one mlp-b64 and mlp-b4096
# step for kiln and JAX with the same autotuning results on both sides of the
# profiler, JAX's timings in the same call, gpt2-small, and the CLI's step
# times. Usage, from a folder holding device_bench, kiln, jax_mlp.py,
# kernels.py, peers.py, this script and fmnist/: bash host.sh
D=$(cd "$(dirname "$0")" && pwd)
export PJRT_DEVICE=CUDA PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/kiln-host}; mkdir -p "$OUT"
q() { nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,pstate --format=csv,noheader; }
filt() { grep -v "^I1\|^W1\|ptxas\|^kiln on\|^20[0-9][0-9]-"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; q
echo "== A: mlp-b64 in four processes, two after the compile workload"
for w in "compile mlp64" "mlp64" "compile mlp64" "mlp64"; do
  echo "-- device_bench $w (clocks before: $(q))"
  timeout 60 "$D/device_bench" $w 2>&1 | filt
done
echo "== B: JAX (peers.py jax)"
OUT=/tmp/peers timeout 60 python3 "$D/peers.py" jax 2>&1 | grep -v Warning | grep "jit"
echo "== C: XLA dumps and autotuning results, then ncu with those results loaded"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for b in 64 4096; do
  for who in kiln jax; do
    if [ $who = kiln ]; then cmd=("$D/device_bench" profile-mlp $b); else cmd=(python3 "$D/jax_mlp.py" $b); fi
    at=/tmp/at-$who-$b.txt
    XLA_FLAGS="--xla_dump_to=/tmp/dump-$who-$b --xla_dump_hlo_as_text --xla_gpu_dump_autotune_results_to=$at" \
      timeout 60 "${cmd[@]}" 3 2>&1 | filt | tail -2
    flags=""; [ -s $at ] && flags="--xla_gpu_load_autotune_results_from=$at"
    XLA_FLAGS="$flags" timeout 100 "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
      "${cmd[@]}" 30 > "$OUT/ncu-$who-$b.csv" 2> /tmp/ncu-$who-$b.err
    echo "ncu $who b$b: rc $? $(wc -l < "$OUT/ncu-$who-$b.csv") lines, autotune file $(wc -c < $at 2>/dev/null)"
  done
  python3 "$D/kernels.py" "$OUT/ncu-kiln-$b.csv" "$OUT/ncu-jax-$b.csv" | tee "$OUT/kernels-$b.md"
done
tar czf "$OUT/dumps.tgz" -C /tmp dump-kiln-64 dump-jax-64 dump-kiln-4096 dump-jax-4096 2>/dev/null
echo "== D: gpt2-small and mlp-b4096 (device_bench gpt mlp4096)"
q; timeout 120 "$D/device_bench" mlp4096 gpt 2>&1 | filt
echo "== E: kiln train mlp, hidden 4096 4096, batch 4096 and 64, 60 steps"
for b in 4096 64; do
  timeout 60 "$D/kiln" train mlp --data "$D/fmnist" --hidden 4096,4096 --batch $b --max-steps 60 --json 2>&1 | filt | tail -3
done
q; date -u
