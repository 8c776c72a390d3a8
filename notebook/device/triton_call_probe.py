"""How XLA's CUDA plugin takes a Triton kernel of one's own: lowers a Pallas
kernel through JAX and prints the `__gpu$xla.gpu.triton` custom call (its
backend config: name, ir, grid, num_warps, num_stages), then runs it.

    python3 triton_call_probe.py       # on the device

Result (2026-11-24, jax 0.11.2): the call runs; `ir` is the Triton module as
MLIR bytecode. benches/RESULTS.md, "kiln's own kernels for the MLP's backward";
docs/memory-journal.md, "Kernels of one's own for the 2× point".
"""
import jax, jax.numpy as jnp, traceback
from jax.experimental import pallas as pl
print('jax', jax.__version__, jax.devices())
def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0
x = jnp.arange(1024, dtype=jnp.float32)
for kw in [dict(backend='triton'), dict()]:
    try:
        f = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)
        lo = jax.jit(f).lower(x)
        txt = lo.as_text()
        print('==== kw', kw)
        for line in txt.splitlines():
            if 'custom_call' in line:
                print(line[:3000])
        print('result', f(x)[:4])
        break
    except Exception:
        traceback.print_exc()
