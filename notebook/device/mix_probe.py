# Bisects the CUDA plugin's slow compile of kiln's init program with JAX
# programs of the same ops over N elements: the SplitMix64 mix with the
# shifts as unsigned divisions (kiln's form) or as shifts, with and without
# the Box-Muller floats.
import sys, time
import jax, jax.numpy as jnp
from jax import lax
jax.config.update("jax_enable_x64", True)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 124_354_560
u = jnp.uint64
G, M1, M2 = u(0x9E3779B97F4A7C15), u(0xBF58476D1CE4E5B9), u(0x94D049BB133111EB)
def mix(z, shr):
    z = (z ^ shr(z, 30)) * M1
    z = (z ^ shr(z, 27)) * M2
    return z ^ shr(z, 31)
div = lambda z, b: z // u(1 << b)
shift = lambda z, b: lax.shift_right_logical(z, jnp.full(z.shape, b, jnp.uint64))
def state(k, lane):
    return k + u(lane) * G + lax.iota(jnp.uint64, N) * (u(2) * G)
def normal(k, shr):
    u1 = (mix(state(k, 0), shr) // u(2048)).astype(jnp.float64) * (1.0 / 2**53)
    u2 = (mix(state(k, 1), shr) // u(2048)).astype(jnp.float64) * (1.0 / 2**53)
    return (jnp.sqrt(jnp.log(1.0 - u1) * -2.0) * jnp.cos(u2 * 6.283185307179586) * 0.02).astype(jnp.float32)
variants = {
    "mix, divide": lambda k: mix(state(k, 0), div),
    "mix, shift": lambda k: mix(state(k, 0), shift),
    "divide only (k + iota) // 2^30": lambda k: (lax.iota(jnp.uint64, N) + k) // u(1 << 30),
    "xor-divide (z ^ z // 2^30)": lambda k: (lambda z: z ^ (z // u(1 << 30)))(lax.iota(jnp.uint64, N) + k),
    "box-muller, shift": lambda k: normal(k, shift),
    "box-muller, divide": lambda k: normal(k, div),
}
k = u(12345)
for name, f in variants.items():
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(k)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    print(f"N={N} {name:32s} compile {1e3*(t2-t1):9.1f} ms", flush=True)
