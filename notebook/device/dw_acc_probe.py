"""The fused LM-head loss's running dw on XLA CUDA: gpt2-small's shapes
(h [8192, 768] bf16, w [50304, 768] bf16, 4 row blocks chained by barriers
as kiln emits them), each block's dw share made three ways, and a fourth form:

  rounded   dot in bf16, converted to f32, added to the running sum
            (kiln's expansion until now: cuBLAS writes a bf16 share, a loop
            kernel reads it and the running sum and writes the sum)
  f32_orig  dot with an f32 result added to the running sum, the add reading
            the running sum from before the block's barrier
  f32_pass  the same, the add reading the running sum through the barrier
            (the barrier's result is its only reader)
  pick_w    rounded, with the label's logit taken as h . w[label] instead
            of from the block's logits (the softmax gradient then reads the
            logits elementwise only)

Each line: mean wall time per call (200 calls), XLA's temp bytes, and the
GEMMs writing f32[50304,768] in the optimized module (beta, aliasing).

    ROWS=2048 FORMS="rounded pick_w" python3 dw_acc_probe.py   # on the device (H100)

ROWS: rows per block (default 2053); FORMS: the forms to run (default the
first three). Results: benches/RESULTS.md, "The LM head's running dw and
block rows".
"""
import os
import re

import jax
import jax.numpy as jnp
from jax import lax

from jax_timing import mean_us
from lm_head_inputs import N, TN, V, inputs

C = int(os.environ.get("ROWS", "2053"))  # rows per block; kiln chose 2053 for 394 MiB blocks
h, w, labels = inputs()


def loss(h, w, labels, form):
    acc = None
    nll, dh = [], []
    for s in range(0, N, C):
        e = min(s + C, N)
        hb = h[s:e]
        if acc is not None:
            hb, acc_passed = lax.optimization_barrier((hb, acc))
            if form == "f32_pass":
                acc = acc_passed
        logits = (hb @ w.T).astype(jnp.float32)
        m = jnp.max(logits, 1, keepdims=True)
        ex = jnp.exp(logits - m)
        z = jnp.sum(ex, 1, keepdims=True)
        onehot = (jnp.arange(V)[None, :] == labels[s:e, None]).astype(jnp.float32)
        if form == "pick_w":
            # the label's logit from its row of w, not from the block's logits
            picked = jnp.sum(hb.astype(jnp.float32) * w[labels[s:e]].astype(jnp.float32), 1)
            picked = picked.astype(jnp.bfloat16).astype(jnp.float32)
        else:
            picked = jnp.sum(logits * onehot, 1)
        nll.append(jnp.log(z[:, 0]) + m[:, 0] - picked)
        dl = ((ex / z - onehot) * (1.0 / N)).astype(jnp.bfloat16)
        dh.append(dl @ w)
        if form in ("rounded", "pick_w"):
            part = lax.dot_general(dl, hb, TN).astype(jnp.float32)
        else:
            part = lax.dot_general(dl, hb, TN, preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return jnp.concatenate(nll), jnp.concatenate(dh), acc.astype(jnp.bfloat16)


results = {}
for rep in range(2):
    for form in os.environ.get("FORMS", "rounded f32_orig f32_pass").split():
        f = jax.jit(lambda h, w, l, form=form: loss(h, w, l, form))
        c = f.lower(h, w, labels).compile()
        temp = c.memory_analysis().temp_size_in_bytes
        dt, out = mean_us(f, h, w, labels)
        results[form] = out
        print(f"{form:9s} {dt:8.1f} us  temp {temp / 2**20:8.1f} MiB", flush=True)
        if rep == 0:
            text = c.as_text().splitlines()
            for line in text:
                if "custom-call" in line and "f32[50304,768]" in line.split("custom-call(")[0]:
                    beta = re.search(r'"beta":[0-9.]+', line)
                    alias = "output_to_operand_aliasing" in line
                    if beta:
                        print(f"   gemm -> f32[50304,768] {beta.group(0)} aliased={alias} operands={line.split('custom-call(')[1].split(')')[0]}")
            adds = [l for l in text if re.match(r"\s*%\S+ = f32\[50304,768\]\S* fusion\(", l)]
            print(f"   fusions writing f32[50304,768]: {len(adds)}")
ref = results["rounded"][2].astype(jnp.float32)
for form in [f for f in results if f != "rounded"]:
    d = jnp.abs(results[form][2].astype(jnp.float32) - ref)
    print(f"{form} dw vs rounded: max abs diff {float(d.max()):.3e}, max |dw| {float(jnp.abs(ref).max()):.3e}")
