"""JAX's mlp-b4096 step alone (the definition of ../shared/bench/peers.py's
MLP: 784-4096-4096-10, AdamW, cross-entropy), N steps, for XLA dumps and a
kernel profile beside kiln's. Usage: jax_mlp.py [BATCH] [STEPS]"""
import sys
import jax, jax.numpy as jnp, optax

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
ks = jax.random.split(jax.random.PRNGKey(0), 4)
sizes = [784, 4096, 4096, 10]
params = [(jax.random.normal(ks[i], (sizes[i], sizes[i + 1])) * 0.02, jnp.zeros(sizes[i + 1])) for i in range(3)]
opt = optax.adamw(1e-3)
state = opt.init(params)
x = jax.random.normal(ks[3], (batch, 784))
y = jax.random.randint(ks[3], (batch,), 0, 10)

def loss_fn(p):
    h = x
    for i, (w, b) in enumerate(p):
        h = h @ w + b
        if i < 2:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

@jax.jit
def step(p, s):
    g = jax.grad(loss_fn)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

for _ in range(steps):
    params, state = step(params, state)
jax.block_until_ready(params)
print(f"jax mlp-b{batch}: {steps} steps")
