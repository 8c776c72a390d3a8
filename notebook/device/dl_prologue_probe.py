"""Can XLA CUDA make the fused LM-head loss's `dl = scale * (softmax - onehot)`
inside the two GEMMs that read it, so a block's dl never exists beside its
logits? gpt2-small's shapes (h [8192, 768] bf16, w [50304, 768] bf16, row
blocks chained by barriers as kiln emits them), two forms of dl:

  zdiv   exp(logits - max) / z - onehot, from the reduction's exponentials
         (kiln's fused expansion, `compiler/src/composite/lm_head.rs`)
  lse    exp(logits - lse) - onehot, one per-row broadcast
  dus2, loopK   dl written over the bf16 logits in parts (`in_place_dl`)
  …g     any of them with the label's logit gathered, not reduced

Each line: mean wall time per call (200 calls), XLA's temp bytes, how many
GEMMs ran as cuBLAS calls and as Triton fusions, and how many Triton fusions
compute an exponential (dl made in the GEMM's prologue). Run it under
several XLA_FLAGS, one process each:

    for f in "" "--xla_gpu_cublas_fallback=false"; do
      XLA_FLAGS="$f" ROWS=2048 python3 dl_prologue_probe.py; done
"""
import os
import re

import jax
import jax.numpy as jnp
from jax import lax

from jax_timing import mean_us
from lm_head_inputs import N, TN, V, inputs

C = int(os.environ.get("ROWS", "2048"))
h, w, labels = inputs()


def loss(h, w, labels, form):
    gathered = form.endswith("g")
    form = form[:-1] if gathered else form
    acc = None
    nll, dh = [], []
    for s in range(0, N, C):
        e = min(s + C, N)
        hb = h[s:e]
        if acc is not None:
            # the previous block's nll too, so its picked logit is taken before this block starts
            hb, acc, nll[-1] = lax.optimization_barrier((hb, acc, nll[-1]))
        lb = hb @ w.T
        logits = lb.astype(jnp.float32)
        m = jnp.max(logits, 1, keepdims=True)
        ex = jnp.exp(logits - m)
        z = jnp.sum(ex, 1, keepdims=True)
        onehot = (jnp.arange(V)[None, :] == labels[s:e, None]).astype(jnp.float32)
        if gathered:
            # the label's logit gathered from the bf16 logits: no reduction reads them elementwise
            picked = jnp.take_along_axis(lb, labels[s:e, None], axis=1)[:, 0].astype(jnp.float32)
        else:
            picked = jnp.sum(logits * onehot, 1)
        lse = jnp.log(z) + m
        nll.append(lse[:, 0] - picked)
        if form in ("zdiv", "lse"):
            p = ex / z if form == "zdiv" else jnp.exp(logits - lse)
            dl = ((p - onehot) * (1.0 / N)).astype(jnp.bfloat16)
        else:
            dl = in_place_dl(lb, lse, labels[s:e], form)
        dh.append(dl @ w)
        part = lax.dot_general(dl, hb, TN).astype(jnp.float32)
        acc = part if acc is None else acc + part
    return jnp.concatenate(nll), jnp.concatenate(dh), acc.astype(jnp.bfloat16)


def dl_part(x, lse, lab, start):
    """dl of columns start.. of a block from its bf16 logits x."""
    cols = start + jnp.arange(x.shape[1])[None, :]
    onehot = (cols == lab[:, None]).astype(jnp.float32)
    return ((jnp.exp(x.astype(jnp.float32) - lse) - onehot) * (1.0 / N)).astype(jnp.bfloat16)


def in_place_dl(lb, lse, lab, form):
    """dl written over the block's bf16 logits, a part of the columns at a
    time, each part read from the slice it is written to:
      dus2   two static halves (dynamic-slice/update-slice, constant starts)
      loopK  a fori_loop over K parts with dynamic starts"""
    if form == "dus2":
        half = V // 2
        for start, width in ((0, half), (half, V - half)):
            x = lax.dynamic_slice(lb, (0, start), (lb.shape[0], width))
            lb = lax.dynamic_update_slice(lb, dl_part(x, lse, lab, start), (0, start))
        return lb
    k = int(form[4:])
    width = V // k

    def body(i, buf):
        start = i * width
        x = lax.dynamic_slice(buf, (0, start), (buf.shape[0], width))
        return lax.dynamic_update_slice(buf, dl_part(x, lse, lab, start), (0, start))

    return lax.fori_loop(0, k, body, lb)


def computations(text):
    """name -> body lines of each computation in an HLO module's text."""
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


flags = os.environ.get("XLA_FLAGS", "")
results = {}
for form in os.environ.get("FORMS", "zdiv lse").split():
    f = jax.jit(lambda h, w, l, form=form: loss(h, w, l, form))
    c = f.lower(h, w, labels).compile()
    temp = c.memory_analysis().temp_size_in_bytes
    text = c.as_text()
    comps = computations(text)
    cublas = len(re.findall(r"custom_call_target=\"__cublas", text))
    triton, triton_exp = 0, 0
    for line in text.splitlines():
        if "__triton_gemm" in line and " fusion(" in line:
            triton += 1
            called = re.search(r"calls=%?([\w.\-]+)", line).group(1)
            if any("exponential(" in l for l in comps.get(called, [])):
                triton_exp += 1
    dt, out = mean_us(f, h, w, labels)
    results[form] = out
    print(f"rows {C} flags '{flags}' {form:5s} {dt:8.1f} us  temp {temp / 2**20:8.1f} MiB  "
          f"cublas {cublas} triton {triton} (with exp {triton_exp})", flush=True)
ref = results[next(iter(results))]
for form, out in results.items():
    d = [float(jnp.abs(out[i].astype(jnp.float32) - ref[i].astype(jnp.float32)).max()) for i in range(3)]
    print(f"  {form} vs first: max abs diff nll {d[0]:.3e} dh {d[1]:.3e} dw {d[2]:.3e}")
