"""gpt2-small's fused LM-head loss inputs for the device probes: h [8192, 768]
bf16, w [50304, 768] bf16 (std 0.02), labels [8192] in the vocabulary, drawn
from a fixed key; TN contracts the rows of dl and h (dw = dlᵀ h)."""
import jax
import jax.numpy as jnp

N, D, V = 8192, 768, 50304
TN = (((0,), (0,)), ((), ()))


def inputs():
    """(h, w, labels) as above."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k1, (N, D), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (V, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return h, w, jax.random.randint(k3, (N,), 0, V)
