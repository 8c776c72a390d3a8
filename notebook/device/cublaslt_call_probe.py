"""Does XLA's CUDA backend take a `__cublas$lt$matmul` custom call from its
input (with a GELU epilogue, so a recomputed up-projection would write GELU's
output itself)? CASE is default, bias, bias_gelu or bias_gelu_aux.

    python3 cublaslt_call_probe.py CASE   # on the device (H100)

Result (2026-11-24, jax 0.11.2): XLA aborts in layout assignment for every
case ("Gemm rewriting should run after layout assignment"); kiln never emits
the call. benches/RESULTS.md, "kiln's own kernels for the MLP's backward".
"""
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax_timing import report_us
from jax._src.interpreters import mlir
from jax._src import core
from jax.extend.core import Primitive
bf = jnp.bfloat16
M, K, N = 8192, 768, 3072
WS = 33554432
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k1, (M, K), jnp.float32).astype(bf)
w = (jax.random.normal(k2, (K, N), jnp.float32) * 0.03).astype(bf)
b = (jax.random.normal(k3, (N,), jnp.float32) * 0.1).astype(bf)
def cfg(epi):
    return json.dumps({"gemm_backend_config": {"alpha_imag": 0, "alpha_real": 1, "beta": 0, "damax_output": False,
        "dot_dimension_numbers": {"lhs_batch_dimensions": [], "lhs_contracting_dimensions": ["1"], "rhs_batch_dimensions": [], "rhs_contracting_dimensions": ["0"]},
        "epilogue": epi, "grad_x": False, "grad_y": False, "precision_config": {"algorithm": "ALG_UNSET", "operand_precision": ["DEFAULT", "DEFAULT"]}}})
def make(epi, nout, with_bias):
    p = Primitive('lt_' + epi); p.multiple_results = True
    outs = [core.ShapedArray((M, N), bf)] * nout + [core.ShapedArray((WS,), jnp.int8)]
    p.def_abstract_eval(lambda *a: outs)
    def lower(ctx, *ops):
        from jaxlib.mlir import ir
        def ty(a):
            et = ir.BF16Type.get() if a.dtype == bf else ir.IntegerType.get_signless(8)
            return ir.RankedTensorType.get(list(a.shape), et)
        types = [ty(a) for a in ctx.avals_out]
        return mlir.custom_call("__cublas$lt$matmul", result_types=types, operands=list(ops), backend_config=cfg(epi), api_version=1).results
    mlir.register_lowering(p, lower, platform='cuda')
    p.def_impl(lambda *a: jax.jit(lambda *a: p.bind(*a))(*a))
    return lambda x, w, b: p.bind(x, w, b) if with_bias else p.bind(x, w)
def ref(x, w, b):
    h = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return jax.nn.gelu(h, approximate=True), h
def bench(name, f):
    return report_us(name, jax.jit(f), x, w, b)
g_ref, h_ref = jax.jit(ref)(x, w, b)
case = sys.argv[1]
epi, nout, wb = {"bias": ("BIAS", 1, True), "gelu": ("GELU", 1, False), "bias_gelu": ("BIAS_GELU", 1, True),
                 "bias_gelu_aux": ("BIAS_GELU_AUX", 2, True), "default": ("DEFAULT", 1, False)}[case]
f = make(epi, nout, wb)
out = bench(case, f)
o = np.asarray(out[0].astype(jnp.float32))
want = np.asarray((g_ref if 'GELU' in epi else (h_ref if wb else h_ref - b.astype(jnp.float32))).astype(jnp.float32))
print(case, 'max |out - ref|', float(np.max(np.abs(o - want))), 'ref max', float(np.max(np.abs(want))))
if nout == 2:
    a = np.asarray(out[1].astype(jnp.float32)); print('aux max |aux - h|', float(np.max(np.abs(a - np.asarray(h_ref)))))
