"""Mean wall time of a jitted JAX function, for the device probes: one call
to compile, `warmup` calls, then `n` calls timed together (each call's
launch overlaps the previous kernels, so a call longer than JAX's dispatch
is timed by the GPU)."""
import time

import jax


def mean_us(jf, *args, warmup=10, n=200):
    """`jf(*args)` timed as above: (microseconds per call, the last output)."""
    out = jf(*args)
    jax.block_until_ready(out)
    for _ in range(warmup):
        out = jf(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(n):
        out = jf(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6, out


def report_us(name, jf, *args, warmup=10, width=16):
    """`jf(*args)` timed by `mean_us`, printed as one line `NAME  T us`;
    returns the last output."""
    dt, out = mean_us(jf, *args, warmup=warmup)
    print(f"{name:{width}s} {dt:7.1f} us", flush=True)
    return out
