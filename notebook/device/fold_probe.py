# Which StableHLO construct makes the CUDA plugin's compile slow on large
# shapes? Each variant is jitted over N = 124,354,560 elements (gpt2-small's
# normal parameters) and timed from lowering to a compiled executable.
import time, sys
import jax, jax.numpy as jnp
from jax import lax
jax.config.update("jax_enable_x64", True)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 124_354_560
C = jnp.uint64(0x9E3779B97F4A7C15)
def iota():
    return lax.iota(jnp.uint64, N)
variants = {
    "trivial k+1 (scalar)": lambda k: k + jnp.uint64(1),
    "broadcast constant + k": lambda k: k + jnp.full((N,), C, jnp.uint64),
    "iota + k": lambda k: iota() + k,
    "k + iota*C (iota*C constant-only)": lambda k: k + iota() * C,
    "(iota + k)*C": lambda k: (iota() + k) * C,
    "where(iota >= c) (constant-only compare)": lambda k: jnp.where(iota() >= jnp.uint64(1000), k, k + jnp.uint64(1)),
    "where(iota + k >= c)": lambda k: jnp.where(iota() + k >= jnp.uint64(1000), k, k + jnp.uint64(1)),
    "f64 cos(iota*c) (constant-only)": lambda k: jnp.cos(iota().astype(jnp.float64) * 1e-9) + k.astype(jnp.float64),
    "f64 cos((iota+k)*c)": lambda k: jnp.cos((iota() + k).astype(jnp.float64) * 1e-9),
}
k = jnp.uint64(0)
for name, f in variants.items():
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(k)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    print(f"{name:45s} lower {1e3*(t1-t0):8.1f} ms  compile {1e3*(t2-t1):9.1f} ms", flush=True)
