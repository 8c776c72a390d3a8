"""gpt2-small (12L d768 12H, seq 1024, batch 8, vocab 50304) in JAX, the
training step of `../shared/bench/peers.py`'s torch GPT: bf16 compute, f32
master weights and logits, tied LM head, AdamW (optax). Attention through
`jax.nn.dot_product_attention(..., implementation=IMPL, is_causal=True)`.
Usage: jax_gpt.py [cudnn|xla] [time|profile N] [--checkpoint] [--json FILE] [--tiny]
  time: median ms/step (5 warm-up, 3 runs of 10 steps) and XLA temp bytes.
  profile N: N steps after warm-up (for a kernel profiler).
  --checkpoint: `jax.checkpoint` on every block (full-block rematerialization:
  the backward keeps only each block's input and recomputes the block).
  --json FILE: also write the figures (ms, runs, XLA memory stats) as JSON."""
import sys, time, statistics, json
from functools import partial
import jax, jax.numpy as jnp, optax

B, T, L, D, H, V = 8, 1024, 12, 768, 12, 50304
if "--tiny" in sys.argv:  # a small shape for checking the script without a GPU
    B, T, L, D, H, V = 2, 64, 2, 64, 4, 256
argv = sys.argv[1:]
checkpoint = "--checkpoint" in argv
json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
argv = [a for i, a in enumerate(argv) if a not in ("--checkpoint", "--json", "--tiny") and (i == 0 or argv[i - 1] != "--json")]
impl = argv[0] if len(argv) > 0 else "cudnn"
mode = argv[1] if len(argv) > 1 else "time"
bf = jnp.bfloat16


def init(key):
    ks = iter(jax.random.split(key, 8 + 8 * L))
    n = lambda shape: jax.random.normal(next(ks), shape, jnp.float32) * 0.02
    ln = lambda: (jnp.ones(D), jnp.zeros(D))
    blocks = [{"ln1": ln(), "qkv": (n((D, 3 * D)), jnp.zeros(3 * D)), "proj": (n((D, D)), jnp.zeros(D)),
               "ln2": ln(), "fc": (n((D, 4 * D)), jnp.zeros(4 * D)), "out": (n((4 * D, D)), jnp.zeros(D))}
              for _ in range(L)]
    return {"wte": n((V, D)), "wpe": n((T, D)), "lnf": ln(), "blocks": blocks}


def layer_norm(x, p):
    x = x.astype(jnp.float32)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return ((x - m) * jax.lax.rsqrt(v + 1e-5) * p[0] + p[1]).astype(bf)


def linear(x, p):
    return x @ p[0].astype(bf) + p[1].astype(bf)


def block(x, b):
    qkv = linear(layer_norm(x, b["ln1"]), b["qkv"]).reshape(B, T, 3, H, D // H)
    a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=impl)
    x = x + linear(a.reshape(B, T, D), b["proj"])
    return x + linear(jax.nn.gelu(linear(layer_norm(x, b["ln2"]), b["fc"]), approximate=True), b["out"])


run_block = jax.checkpoint(block) if checkpoint else block


def loss_fn(p, idx, tgt):
    x = (p["wte"][idx] + p["wpe"][None]).astype(bf)
    for b in p["blocks"]:
        x = run_block(x, b)
    logits = (layer_norm(x, p["lnf"]) @ p["wte"].astype(bf).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, V), tgt.reshape(-1)).mean()


opt = optax.adamw(3e-4, weight_decay=0.1)


@partial(jax.jit, donate_argnums=(0, 1))
def step(p, s, idx, tgt):
    loss, g = jax.value_and_grad(loss_fn)(p, idx, tgt)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


params = init(jax.random.PRNGKey(0))
state = opt.init(params)
k1, k2 = jax.random.split(jax.random.PRNGKey(1))
idx = jax.random.randint(k1, (B, T), 0, min(V, 50257))
tgt = jax.random.randint(k2, (B, T), 0, min(V, 50257))
t0 = time.perf_counter()
step = step.lower(params, state, idx, tgt).compile()  # the one compile; calls below reuse it
compile_s = time.perf_counter() - t0
mem = step.memory_analysis()
for _ in range(5):
    params, state, loss = step(params, state, idx, tgt)
jax.block_until_ready(loss)
if mode == "profile":
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    for _ in range(n):
        params, state, loss = step(params, state, idx, tgt)
    jax.block_until_ready(loss)
    print(f"profile: {n} steps, loss {float(loss):.4f}")
else:
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(10):
            params, state, loss = step(params, state, idx, tgt)
        jax.block_until_ready(loss)
        ts.append((time.perf_counter() - t) / 10 * 1e3)
    name = f"jax-{impl}" + ("-checkpoint" if checkpoint else "")
    print(f"{name} gpt2-small {statistics.median(ts):.3f} ms/step (runs {[round(t, 3) for t in ts]}), "
          f"XLA temp {mem.temp_size_in_bytes} B, loss {float(loss):.4f}")
    if json_path:
        xla = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
               "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes}
        xla["peak_bytes"] = xla["argument_bytes"] + xla["output_bytes"] - xla["alias_bytes"] + xla["temp_bytes"]
        with open(json_path, "w") as f:
            json.dump({"system": name, "config": "gpt2-small", "ms": statistics.median(ts), "runs_ms": ts,
                       "compile_s": compile_s, "xla": xla, "loss_last": float(loss)}, f)
