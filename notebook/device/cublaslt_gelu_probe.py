"""Does XLA fuse a bias and GELU into the cuBLASLt GEMM that computes them?
Forms of `gelu(x W + b)` (bf16, gpt2-small's MLP on 8192 tokens) jitted by
JAX; for each, the cuBLASLt epilogues and custom calls in XLA's optimized
module and the wall time per call. Run with and without
XLA_FLAGS=--xla_gpu_enable_cublaslt=true.

    python3 cublaslt_gelu_probe.py     # on the device (H100)

Results: benches/RESULTS.md, "kiln's own kernels for the MLP's backward".
"""
import os, re, jax, jax.numpy as jnp
from jax_timing import mean_us
bf = jnp.bfloat16
M, K, N = 8192, 768, 3072
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k1, (M, K), jnp.float32).astype(bf)
w = (jax.random.normal(k2, (K, N), jnp.float32) * 0.03).astype(bf)
b = (jax.random.normal(k3, (N,), jnp.float32) * 0.1).astype(bf)
def v_plain(x, w, b):  # GEMM + bias, no activation
    return jnp.dot(x, w) + b
def v_bf16(x, w, b):
    return jax.nn.gelu(jnp.dot(x, w) + b, approximate=True)
def v_f32(x, w, b):
    y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return jax.nn.gelu(y, approximate=True).astype(bf)
def v_aux(x, w, b):
    h = jnp.dot(x, w) + b
    return jax.nn.gelu(h, approximate=True), h
def v_manual(x, w, b):  # kiln's form: bf16 arithmetic, tanh in f32
    h = jnp.dot(x, w) + b
    u = (h + h * h * h * bf(0.044715)) * bf(0.7978845608028654)
    t = jnp.tanh(u.astype(jnp.float32)).astype(bf)
    return h * bf(0.5) * (t + bf(1.0))
def bench(name, f):
    jf = jax.jit(f)
    txt = jf.lower(x, w, b).compile().as_text()
    epi = sorted(set(re.findall(r'"epilogue":"(\w+)"', txt)))
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', txt)))
    nf = len(re.findall(r' fusion\(', txt))
    dt, _ = mean_us(jf, x, w, b)
    print(f"{name:10s} {dt:7.1f} us  epilogues {epi} calls {calls} fusions {nf}", flush=True)
print('XLA_FLAGS', os.environ.get('XLA_FLAGS'))
for rep in range(2):
    for name, f in [('plain', v_plain), ('bf16', v_bf16), ('f32', v_f32), ('aux', v_aux), ('manual', v_manual)]:
        bench(name, f)
