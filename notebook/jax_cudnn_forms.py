"""Prints the cuDNN custom calls JAX emits for attention with a bias, a mask
and grouped key/value heads (forward and gradient), to read the operand
order, layouts and backend_config kiln's lowering must match. One-off probe."""
import re
import jax
import jax.numpy as jnp

B, T, S, N, K, H = 2, 128, 128, 8, 2, 64
key = jax.random.PRNGKey(0)
q = jax.random.normal(key, (B, T, N, H), jnp.bfloat16)
kv = jax.random.normal(key, (B, S, N, H), jnp.bfloat16)
kv_g = jax.random.normal(key, (B, S, K, H), jnp.bfloat16)


def show(name, f, *args):
    try:
        text = jax.jit(f).lower(*args).compile().as_text()
    except Exception as e:  # noqa: BLE001
        print(f"== {name}: FAILED {type(e).__name__}: {str(e)[:400]}")
        return
    print(f"== {name}")
    for line in text.splitlines():
        if "custom-call" in line and "cudnn" in line:
            line = re.sub(r'"algorithm":\{[^}]*\{[^}]*\}[^}]*\},', '"algorithm":{..},', line)
            print("  ", line.strip()[:1800])


def loss(bias=None, mask=None, kvv=kv, causal=False):
    def f(q, k, v, *extra):
        b = extra[0] if bias is not None else None
        o = jax.nn.dot_product_attention(q, k, v, bias=b, mask=mask, is_causal=causal, implementation="cudnn")
        return (o.astype(jnp.float32) ** 2).sum()
    return f


b_1h = jax.random.normal(key, (1, N, T, S), jnp.bfloat16)
b_b1 = jax.random.normal(key, (B, 1, T, S), jnp.bfloat16)
m_b1 = jax.random.bernoulli(key, 0.8, (B, 1, T, S))
show("bias [1,N,T,S] grad", jax.grad(loss(bias=b_1h), argnums=(0, 1, 2, 3)), q, kv, kv, b_1h)
show("bias [B,1,T,S] grad (q,k,v)", jax.grad(loss(bias=b_b1), argnums=(0, 1, 2)), q, kv, kv, b_b1)
show("mask [B,1,T,S] grad", jax.grad(loss(mask=m_b1), argnums=(0, 1, 2)), q, kv, kv)
show("GQA causal grad", jax.grad(loss(causal=True), argnums=(0, 1, 2)), q, kv_g, kv_g)
show("cross T=128 S=256", jax.grad(loss(), argnums=(0, 1, 2)), q, jnp.zeros((B, 256, N, H), jnp.bfloat16) + 1, jnp.ones((B, 256, N, H), jnp.bfloat16))
