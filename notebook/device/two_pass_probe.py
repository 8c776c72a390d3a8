"""The fused LM-head loss in two passes on XLA CUDA: gpt2-small's shapes
(h [8192, 768] bf16, w [50304, 768] bf16). Does a loss that takes each row's
log-sum-exp first (row blocks) and then makes the gradient a part of the
vocabulary at a time (all rows, so each part's dw rows are final and no f32
running dw exists) hold less than kiln's one-pass row blocks, and for how
much time?

  rows        kiln's expansion (`compiler/src/composite/lm_head.rs`): row
              blocks chained by barriers, the label's logit gathered, dl
              written over the logits in two column halves, f32 running dw
  two:R:K     pass 1: blocks of R rows give lse (and the label's logit);
              pass 2: K vocabulary parts, each h wᵥᵀ again, dl over it in
              two halves, its dw rows written into dw in place, dh summed
              in f32
  twoplain:R:K  the same with dl a value of its own (no halves)
  dhfirst:R:K pass 1 as `rows` without dw (each block's dh finished
              there); pass 2: K parts, each h wᵥᵀ again, dl a value of its
              own, its dw rows written into dw in place

Each line: mean wall time per call (200 calls), XLA's temp bytes; then each
form's largest difference from the first.

    ROWS=2048 FORMS="rows two:1024:8 twoplain:1024:8" python3 two_pass_probe.py

Results: benches/RESULTS.md, "The LM head in two passes".
"""
import os

import jax
import jax.numpy as jnp
from jax import lax

from jax_timing import mean_us
from lm_head_inputs import N, TN, V, inputs

C = int(os.environ.get("ROWS", "2048"))
h, w, labels = inputs()
G = 1.0 / N


def halves(x, f):
    """f(part, start) written over x's columns in two halves, each read from its own range."""
    cols = x.shape[1]
    half = cols // 2
    for start, width in ((0, half), (half, cols - half)):
        s = lax.optimization_barrier(jnp.int32(start))
        part = lax.dynamic_slice(x, (0, s), (x.shape[0], width))
        x = lax.dynamic_update_slice(x, f(part, start), (0, s))
    return x


def block_dl(hb, w, lab):
    """A row block's lse ([rows, 1]), nll, and dl written over its bf16
    logits in halves."""
    lb = hb @ w.T
    logits = lb.astype(jnp.float32)
    m = jnp.max(logits, 1, keepdims=True)
    z = jnp.sum(jnp.exp(logits - m), 1, keepdims=True)
    picked = jnp.take_along_axis(lb, lab[:, None], axis=1)[:, 0].astype(jnp.float32)
    lse = jnp.log(z) + m

    def f(x, start):
        cols = start + jnp.arange(x.shape[1])[None, :]
        onehot = (cols == lab[:, None]).astype(jnp.float32)
        return ((jnp.exp(x.astype(jnp.float32) - lse) - onehot) * G).astype(jnp.bfloat16)

    return lse, lse[:, 0] - picked, halves(lb, f)


def rows(h, w, labels):
    acc = None
    nll, dh = [], []
    for s in range(0, N, C):
        e = min(s + C, N)
        hb = h[s:e]
        if acc is not None:
            hb, acc, nll[-1] = lax.optimization_barrier((hb, acc, nll[-1]))
        _, block_nll, dl = block_dl(hb, w, labels[s:e])
        nll.append(block_nll)
        dh.append(dl @ w)
        part = lax.dot_general(dl, hb, TN).astype(jnp.float32)
        acc = part if acc is None else acc + part
    return jnp.concatenate(nll), jnp.concatenate(dh), acc.astype(jnp.bfloat16)


def two(h, w, labels, r, k, in_place):
    lses, picks = [], []
    for s in range(0, N, r):
        e = min(s + r, N)
        hb = h[s:e]
        if lses:
            hb, lses[-1], picks[-1] = lax.optimization_barrier((hb, lses[-1], picks[-1]))
        lb = hb @ w.T
        logits = lb.astype(jnp.float32)
        m = jnp.max(logits, 1)
        lses.append(jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), 1)) + m)
        picks.append(jnp.take_along_axis(lb, labels[s:e, None], axis=1)[:, 0].astype(jnp.float32))
    lse = jnp.concatenate(lses)
    nll = lse - jnp.concatenate(picks)
    dw = jnp.zeros(w.shape, jnp.bfloat16)
    dh = None
    width = -(-V // k)
    hh = h
    for v0 in range(0, V, width):
        v1 = min(v0 + width, V)
        if dh is None:
            hh, lse, dw = lax.optimization_barrier((hh, lse, dw))
        else:
            hh, lse, dw, dh = lax.optimization_barrier((hh, lse, dw, dh))
        wv = w[v0:v1]
        lv = hh @ wv.T

        def f(x, start, v0=v0):
            cols = v0 + start + jnp.arange(x.shape[1])[None, :]
            onehot = (cols == labels[:, None]).astype(jnp.float32)
            return ((jnp.exp(x.astype(jnp.float32) - lse[:, None]) - onehot) * G).astype(jnp.bfloat16)

        dl = halves(lv, f) if in_place else f(lv, 0)
        dw = lax.dynamic_update_slice(dw, lax.dot_general(dl, hh, TN), (v0, 0))
        part = (dl @ wv).astype(jnp.float32)
        dh = part if dh is None else dh + part
    return nll, dh.astype(jnp.bfloat16), dw


def dh_first(h, w, labels, r, k):
    """Pass 1: row blocks make lse, the nll and dh (dl over the logits in
    halves), no dw; pass 2: k vocabulary parts make dw's rows from lse."""
    nll, lses, dh = [], [], []
    for s in range(0, N, r):
        e = min(s + r, N)
        hb = h[s:e]
        if dh:
            hb, dh[-1], nll[-1] = lax.optimization_barrier((hb, dh[-1], nll[-1]))
        lse, block_nll, dl = block_dl(hb, w, labels[s:e])
        nll.append(block_nll)
        lses.append(lse[:, 0])
        dh.append(dl @ w)
    dh = jnp.concatenate(dh)
    lse = jnp.concatenate(lses)
    dw = jnp.zeros(w.shape, jnp.bfloat16)
    width = -(-V // k)
    hh = h
    for v0 in range(0, V, width):
        v1 = min(v0 + width, V)
        hh, lse, dw, dh = lax.optimization_barrier((hh, lse, dw, dh))
        lv = hh @ w[v0:v1].T
        cols = v0 + jnp.arange(v1 - v0)[None, :]
        onehot = (cols == labels[:, None]).astype(jnp.float32)
        dl = ((jnp.exp(lv.astype(jnp.float32) - lse[:, None]) - onehot) * G).astype(jnp.bfloat16)
        dw = lax.dynamic_update_slice(dw, lax.dot_general(dl, hh, TN), (v0, 0))
    return jnp.concatenate(nll), dh, dw


def form_fn(form):
    if form == "rows":
        return rows
    name, r, k = form.split(":")
    if name == "dhfirst":
        return lambda h, w, l: dh_first(h, w, l, int(r), int(k))
    return lambda h, w, l: two(h, w, l, int(r), int(k), name == "two")


flags = os.environ.get("XLA_FLAGS", "")
results = {}
for form in os.environ.get("FORMS", "rows two:1024:8").split():
    f = jax.jit(form_fn(form))
    c = f.lower(h, w, labels).compile()
    temp = c.memory_analysis().temp_size_in_bytes
    dt, out = mean_us(f, h, w, labels)
    results[form] = out
    print(f"rows {C} flags '{flags}' {form:14s} {dt:8.1f} us  temp {temp / 2**20:8.1f} MiB", flush=True)
ref = results[next(iter(results))]
for form, out in results.items():
    d = [float(jnp.abs(out[i].astype(jnp.float32) - ref[i].astype(jnp.float32)).max()) for i in range(3)]
    print(f"  {form} vs first: max abs diff nll {d[0]:.3e} dh {d[1]:.3e} dw {d[2]:.3e}")
