"""The bias gradient beside a recomputed GELU's backward, in kiln's form: dh in
bf16 arithmetic and its row sum a bf16 `reduce` over the tokens of
[8, 1024, 3072] (gpt2-small's MLP). In the 50% plan's trace XLA's kernel that
recomputes GELU, writes dh and gelu(h) and sums dh took 102 µs a layer, where
the unplanned kernel (reading a saved tanh) took 71.5 and the same kernel
without the sum 72.5 (`gelu_bwd_probe.py`). Ways to sum dh that might not slow
the kernel: partial sums over r tokens in the kernel and the rest in a second
one, the sum split off by a barrier, a dot with a ones vector, or the sum
folded into the weight gradient's GEMM as a row of ones beside the layer
norm's output. Each line: mean wall time per call of the jitted function, 200
calls, two passes.

    python3 bias_grad_probe.py         # on the device (H100)

Results: benches/RESULTS.md, "The bias gradient split off a recomputed GELU".
"""
import jax, jax.numpy as jnp
from jax import lax
from jax_timing import report_us

bf = jnp.bfloat16
C, A = 0.7978845608028654, 0.044715
B, T, D, F = 8, 1024, 768, 3072
k = jax.random.split(jax.random.PRNGKey(0), 4)
dg = (jax.random.normal(k[0], (B, T, F), jnp.float32) * 0.1).astype(bf)
h = jax.random.normal(k[1], (B, T, F), jnp.float32).astype(bf)
x = jax.random.normal(k[2], (B * T, D), jnp.float32).astype(bf)
tsaved = jnp.tanh((C * (h.astype(jnp.float32) + A * h.astype(jnp.float32) ** 3))).astype(bf)


def tanh_of(h):
    u = (h + h * h * h * bf(A)) * bf(C)
    return jnp.tanh(u.astype(jnp.float32)).astype(bf)


def dgelu(dg, h, t):
    # d/dh of 0.5 h (1 + t): 0.5 (1 + t) + 0.5 h (1 - t^2) C (1 + 3 A h^2), in bf16 ops.
    d = bf(0.5) * (t + bf(1)) + bf(0.5) * h * (bf(1) - t * t) * bf(C) * (bf(1) + bf(3 * A) * h * h)
    return dg * d


def bsum(v, axes):
    return lax.reduce(v, bf(0), lax.add, axes)


def planned_parts(dg, h):
    t = tanh_of(h)
    g = h * bf(0.5) * (t + bf(1))
    return dgelu(dg, h, t), g


def unplanned(dg, h, t):
    dh = dgelu(dg, h, t)
    return dh, bsum(dh, (0, 1))


def planned(dg, h):
    dh, g = planned_parts(dg, h)
    return dh, g, bsum(dh, (0, 1))


def planned_nodb(dg, h):
    return planned_parts(dg, h)


def planned_split(dg, h):
    dh, g = planned_parts(dg, h)
    return dh, g, bsum(lax.optimization_barrier(dh), (0, 1))


def partial(r, dh):
    p = bsum(dh.reshape(B * T // r, r, F), (1,))
    return bsum(lax.optimization_barrier(p), (0,))


def planned_r(r):
    def f(dg, h):
        dh, g = planned_parts(dg, h)
        return dh, g, partial(r, dh)
    return f


def unplanned_r(r):
    def f(dg, h, t):
        dh = dgelu(dg, h, t)
        return dh, partial(r, dh)
    return f


def planned_dot(dg, h):
    dh, g = planned_parts(dg, h)
    ones = jnp.ones((B * T,), bf)
    db = jnp.dot(ones, lax.optimization_barrier(dh).reshape(B * T, F), preferred_element_type=jnp.float32)
    return dh, g, db.astype(bf)


def dw(rows):
    xa = jnp.concatenate([x, jnp.ones((B * T, rows - D), bf)], 1) if rows > D else x
    xa = jax.block_until_ready(xa)
    dh2 = dg.reshape(B * T, F)
    return (lambda xa, dh2: jnp.dot(xa.T, dh2, preferred_element_type=jnp.float32).astype(bf)), xa, dh2


def bench(name, f, *args):
    report_us(name, jax.jit(f), *args, warmup=20, width=18)


for rep in range(2):
    bench('unplanned', unplanned, dg, h, tsaved)
    bench('planned', planned, dg, h)
    bench('planned_nodb', planned_nodb, dg, h)
    bench('planned_split', planned_split, dg, h)
    for r in (4, 8, 16, 32, 128):
        bench(f'planned_r{r}', planned_r(r), dg, h)
    for r in (8, 32):
        bench(f'unplanned_r{r}', unplanned_r(r), dg, h, tsaved)
    bench('planned_dot', planned_dot, dg, h)
    for rows in (768, 776, 832):
        f, xa, dh2 = dw(rows)
        bench(f'dw_gemm_{rows}', f, xa, dh2)

# The sums agree with a one-pass f32 sum of the same dh to bf16 rounding.
dh_ref = jax.jit(planned_nodb)(dg, h)[0].astype(jnp.float32)
ref = jnp.sum(dh_ref, (0, 1))
for name, f in [('planned', planned), ('planned_r8', planned_r(8)), ('planned_dot', planned_dot)]:
    db = jax.jit(f)(dg, h)[2].astype(jnp.float32)
    print(name, 'max |db - f32 sum| / max|sum|', float(jnp.max(jnp.abs(db - ref)) / jnp.max(jnp.abs(ref))))
