"""XLA's own kernel for GELU's backward when GELU is recomputed: reading
dg and h, writing dh and gelu(h), with the bias gradient's row sum in the same
fusion (`planned`), without it (`planned_nodb`), split off by a barrier
(`planned_split`), with tanh from exp (`planned_exp`); beside the unplanned
kernel (reads a saved tanh) and the forward's GELU kernel writing one or two
outputs. Each line: mean wall time per call of the jitted function, 200 calls.

    python3 gelu_bwd_probe.py          # on the device (H100)

Results: benches/RESULTS.md, "kiln's own kernels for the MLP's backward".
"""
import jax, jax.numpy as jnp
from jax_timing import report_us
from jax import lax
C = 0.7978845608028654; A = 0.044715
M, N = 8192, 3072
k1, k2 = jax.random.split(jax.random.PRNGKey(0))
dg = (jax.random.normal(k1, (M, N), jnp.float32) * 0.1).astype(jnp.bfloat16)
h = jax.random.normal(k2, (M, N), jnp.float32).astype(jnp.bfloat16)
def tanh_exp(u):
    e = jnp.exp(-2.0 * jnp.abs(u)); t = (1 - e) / (1 + e); return jnp.where(u >= 0, t, -t)
def parts(dg, h, th=jnp.tanh):
    hf = h.astype(jnp.float32)
    t = th(C * (hf + A * hf * hf * hf))
    g = (0.5 * hf * (1 + t)).astype(jnp.bfloat16)
    d = 0.5 * (1 + t) + 0.5 * hf * (1 - t * t) * C * (1 + 3 * A * hf * hf)
    dh = (dg.astype(jnp.float32) * d).astype(jnp.bfloat16)
    return dh, g, t
def planned(dg, h):
    dh, g, _ = parts(dg, h); return dh, g, jnp.sum(dh.astype(jnp.float32), 0)
def planned_nodb(dg, h):
    dh, g, _ = parts(dg, h); return dh, g
def planned_split(dg, h):
    dh, g, _ = parts(dg, h); dh2 = lax.optimization_barrier(dh); return dh, g, jnp.sum(dh2.astype(jnp.float32), 0)
def planned_exp(dg, h):
    dh, g, _ = parts(dg, h, tanh_exp); return dh, g, jnp.sum(dh.astype(jnp.float32), 0)
t_saved = jnp.tanh(C * (h.astype(jnp.float32) * (1 + A * h.astype(jnp.float32)**2))).astype(jnp.bfloat16)
def unplanned(dg, h, t):
    hf = h.astype(jnp.float32); tf = t.astype(jnp.float32)
    d = 0.5 * (1 + tf) + 0.5 * hf * (1 - tf * tf) * C * (1 + 3 * A * hf * hf)
    dh = (dg.astype(jnp.float32) * d).astype(jnp.bfloat16)
    return dh, jnp.sum(dh.astype(jnp.float32), 0)
def fwd(h):
    _, g, t = parts(h, h); return g, t.astype(jnp.bfloat16)
def fwd_one(h):
    _, g, t = parts(h, h); return g
def bench(name, f, *args):
    report_us(name, jax.jit(f), *args, warmup=20)
for rep in range(2):
    bench('unplanned', unplanned, dg, h, t_saved)
    bench('planned', planned, dg, h)
    bench('planned_nodb', planned_nodb, dg, h)
    bench('planned_split', planned_split, dg, h)
    bench('planned_exp', planned_exp, dg, h)
    bench('fwd_two_out', fwd, h)
    bench('fwd_one_out', fwd_one, h)
a = jax.jit(planned)(dg, h); b = jax.jit(planned_exp)(dg, h)
print('exp-tanh dh max diff', float(jnp.max(jnp.abs(a[0].astype(jnp.float32) - b[0].astype(jnp.float32)))), 'g diff', float(jnp.max(jnp.abs(a[1].astype(jnp.float32) - b[1].astype(jnp.float32)))))
