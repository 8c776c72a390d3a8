#!/bin/bash
# Third H100 call of issue 13's init work: the init program's cold compile in
# the flat form (one Box-Muller computation for all normal parameters) vs
# the per-parameter form, the floor (a one-add program), where XLA's GPU
# compile spends its time (dump + phase timers), the disk-cache hit, and an
# element-wise comparison of both forms with host init on the GPU.
# Carried with the stripped `kiln` and `init_setup` binaries and a text.
D=$(cd "$(dirname "$0")" && pwd); K=$D/kiln
export PJRT_DEVICE=CUDA TF_CPP_MIN_LOG_LEVEL=2
echo "== gpu"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for form in flat flat per-parameter; do
  echo "== gpt2-small set-up, $form, no disk cache"
  KILN_CACHE=off KILN_INIT_FORM=$form $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
done
echo "== tiny set-up, flat and per-parameter, no disk cache"
for form in flat per-parameter; do KILN_CACHE=off KILN_INIT_FORM=$form $D/init_setup tiny 2>&1 | grep -v "^[IW]1"; done
echo "== XLA dump + phase timers (fills the disk cache /tmp/kc)"
for form in flat per-parameter; do
  rm -rf /tmp/d_$form
  KILN_CACHE_DIR=/tmp/kc KILN_INIT_FORM=$form TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=gpu_compiler=1,nvptx_compiler=1,nvptx_backend=1,gpu_backend_lib=1,compile_module_to_llvm_ir=1,ptx_compiler_impl=1,cuda_asm_compiler=1,subprocess_compilation=1 \
    XLA_FLAGS="--xla_dump_to=/tmp/d_$form --xla_dump_hlo_as_text" $D/init_setup gpt2-small > /tmp/log_$form.txt 2>&1
  grep -v "^[IW]1" /tmp/log_$form.txt | grep "params\|trivial"
  grep -i "took\|elapsed\| ms\b" /tmp/log_$form.txt | grep -iv "autotun" | sed 's/^.*\] //' > $OUT/phases_$form.txt
  echo "-- $form: $(wc -l < $OUT/phases_$form.txt) timer lines; modules with a cosine:"
  for f in /tmp/d_$form/*after_optimizations.txt; do
    c=$(grep -c "cosine" "$f"); [ "$c" -gt 0 ] || continue
    m=${f%.sm_*}; m=${m%_gpu_after_optimizations.txt}
    echo "   $(basename $f): cosine lines $c, fusion kernels $(grep -c 'kind=k' $f), ptx bytes $(cat ${m}*.ptx 2>/dev/null | wc -c)"
    cp "$f" $OUT/hlo_$form.txt
  done
  grep -E "ptxas|PTX|LLVM|RunBackend|RunHloPasses|Compile" $OUT/phases_$form.txt | awk '{print substr($0,1,200)}' | sort | uniq -c | sort -rn | head -25
done
echo "== gpt2-small set-up, flat, disk cache hit"; KILN_CACHE_DIR=/tmp/kc $D/init_setup gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== element-wise: both forms against host init on the GPU (disk cache)"
KILN_CACHE_DIR=/tmp/kc $D/init_setup --compare gpt2-small 2>&1 | grep -v "^[IW]1"
echo "== tiny gpt through the CLI, device init, no disk cache: setup_ms"
KILN_CACHE=off KILN_INIT=device $K train gpt --config tiny --text $D/text.txt --steps 3 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; v=json.load(sys.stdin); print(v['init'], 'setup_ms %.1f' % v['setup_ms'], 'losses', v['losses'])"
