"""The peers of kiln's four model styles (`kiln_models`: a grouped-query Llama,
a padded BERT, a T5 with relative bias and cross-attention, GPT-2), written in
plain ops as kiln's `Spelling::Plain` writes them: attention as q kᵀ, a mask and
a softmax; norms from means; the loss from log_softmax. The same sizes and the
same bf16 policy (f32 master weights, matmuls in bf16, softmax, norms and loss
in f32), trained with AdamW on a fixed batch.

    python3 models_peers.py jax|torch|hf MODEL [ITERS]

`hf` runs Hugging Face `transformers`' own model of the same sizes
(`LlamaForCausalLM`, `GPT2LMHeadModel`, `BertForMaskedLM`,
`T5ForConditionalGeneration`; its default SDPA attention, dropout off) under
`torch.compile`, the peer the model-zoo issue names.

MODEL is llama, bert, t5 or gpt2. Prints `RESULT {json}`: ms/step (median of
ITERS timed steps after warm-up), tokens/s, compile seconds, peak memory, the
first losses. JAX: `jax.jit` of the whole step (optax.adamw). PyTorch:
`torch.compile` of the forward and loss, `torch.optim.AdamW(fused=True)`."""
import json
import math
import statistics
import sys
import time

import numpy as np

CONFIGS = {
    # name: sizes, batch, sequence lengths
    "llama": dict(vocab=32000, dim=768, layers=12, heads=12, kv_heads=4, ffn=2048, batch=8, seq=1024, eps=1e-5, theta=1e4),
    "gpt2": dict(vocab=50304, dim=768, layers=12, heads=12, batch=8, seq=1024, eps=1e-5),
    "bert": dict(vocab=30522, dim=768, layers=12, heads=12, ffn=3072, batch=32, seq=512, types=2, eps=1e-12),
    "t5": dict(vocab=32128, dim=768, d_kv=64, heads=12, ffn=3072, layers=12, dec_layers=12, buckets=32, max_dist=128,
               batch=16, seq=512, tgt=128, eps=1e-6),
}


def data(name, c, rng):
    """The fixed batch, as numpy arrays."""
    b = c["batch"]
    if name in ("llama", "gpt2"):
        t = c["seq"]
        return dict(ids=rng.integers(0, c["vocab"], (b, t)).astype(np.int32),
                    targets=rng.integers(0, c["vocab"], (b * t,)).astype(np.int32))
    if name == "bert":
        s = c["seq"]
        lengths = rng.integers(s // 2, s + 1, (b,))
        mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.int32)
        weights = (mask * (rng.random((b, s)) < 0.15)).astype(np.float32).reshape(-1)
        weights[0] = 1.0
        return dict(ids=rng.integers(0, c["vocab"], (b, s)).astype(np.int32), types=np.zeros((b, s), np.int32),
                    mask=mask, labels=rng.integers(0, c["vocab"], (b * s,)).astype(np.int32), weights=weights)
    s, l = c["seq"], c["tgt"]
    return dict(ids=rng.integers(0, c["vocab"], (b, s)).astype(np.int32), mask=np.ones((b, s), np.int32),
                labels=rng.integers(0, c["vocab"], (b, l)).astype(np.int32), label_mask=np.ones((b, l), np.int32))


def tokens(name, c):
    if name == "t5":
        return c["batch"] * (c["seq"] + c["tgt"])
    return c["batch"] * c["seq"]


def t5_buckets(t, s, bidirectional, c):
    """T5's relative position buckets `[t, s]` (as `kiln_models::t5` computes
    them in the graph)."""
    rel = np.arange(s)[None, :] - np.arange(t)[:, None]
    buckets = c["buckets"]
    if bidirectional:
        buckets //= 2
        ret = (rel > 0).astype(np.int32) * buckets
        n = np.abs(rel)
    else:
        ret = np.zeros((t, s), np.int32)
        n = np.maximum(-rel, 0)
    exact = buckets // 2
    nf = np.maximum(n, 1).astype(np.float32)
    large = exact + (np.log(nf / exact) / math.log(c["max_dist"] / exact) * (buckets - exact)).astype(np.int32)
    large = np.minimum(large, buckets - 1)
    return (ret + np.where(n < exact, n, large)).astype(np.int32)


# ----------------------------------------------------------------------------- JAX

def run_jax(name, c, iters):
    import jax
    import jax.numpy as jnp
    import optax

    bf = jnp.bfloat16
    key = iter(jax.random.split(jax.random.PRNGKey(0), 4096))

    def normal(shape, std=0.02):
        return std * jax.random.normal(next(key), shape, jnp.float32)

    def mm(x, w):
        return jnp.matmul(x.astype(bf), w.astype(bf))

    def rms(x, g, eps):
        x32 = x.astype(jnp.float32)
        return g * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps))

    def ln(x, g, b, eps):
        x = x.astype(jnp.float32)
        m = jnp.mean(x, -1, keepdims=True)
        v = jnp.mean((x - m) ** 2, -1, keepdims=True)
        return (x - m) / jnp.sqrt(v + eps) * g + b

    def softmax(s):
        s = s.astype(jnp.float32)
        e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
        return e / jnp.sum(e, -1, keepdims=True)

    def heads(x, n):
        b, t, _ = x.shape
        return x.reshape(b, t, n, -1).transpose(0, 2, 1, 3)

    def merge(x):
        b, h, t, d = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)

    def ce_onehot(logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32), -1)

    d = c["dim"]
    if name == "llama":
        hd = d // c["heads"]
        p = dict(embed=normal((c["vocab"], d)), norm=jnp.ones(d), layers=[
            dict(an=jnp.ones(d), wq=normal((d, d)), wk=normal((d, c["kv_heads"] * hd)), wv=normal((d, c["kv_heads"] * hd)),
                 wo=normal((d, d)), mn=jnp.ones(d), gate=normal((d, c["ffn"])), up=normal((d, c["ffn"])),
                 down=normal((c["ffn"], d))) for _ in range(c["layers"])])

        def rope(x, cos, sin):
            h = x.shape[-1] // 2
            a, b2 = x[..., :h], x[..., h:]
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
            return jnp.concatenate([a * cos - b2 * sin, b2 * cos + a * sin], -1)

        def loss(p, batch):
            ids, targets = batch["ids"], batch["targets"]
            b, t = ids.shape
            half = hd // 2
            inv = c["theta"] ** (-(2 * jnp.arange(half)) / (2 * half))
            ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
            cos, sin = jnp.cos(ang), jnp.sin(ang)
            x = p["embed"][ids]
            causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
            for l in p["layers"]:
                n = rms(x, l["an"], c["eps"])
                q = rope(heads(mm(n, l["wq"]), c["heads"]), cos, sin)
                k = rope(heads(mm(n, l["wk"]), c["kv_heads"]), cos, sin)
                v = heads(mm(n, l["wv"]), c["kv_heads"])
                g = c["heads"] // c["kv_heads"]
                k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
                s = jnp.matmul(q, k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
                s = jnp.where(causal, s, -1e9)
                a = jnp.matmul(softmax(s).astype(bf), v)
                x = x + mm(merge(a), l["wo"])
                n = rms(x, l["mn"], c["eps"])
                gt = mm(n, l["gate"])
                x = x + mm(gt * jax.nn.sigmoid(gt) * mm(n, l["up"]), l["down"])
            h = rms(x, p["norm"], c["eps"]).reshape(b * t, d)
            return jnp.mean(ce_onehot(mm(h, p["embed"].T), targets))
    elif name == "gpt2":
        hd = d // c["heads"]
        p = dict(wte=normal((c["vocab"], d)), wpe=normal((c["seq"], d), 0.01), lnf=(jnp.ones(d), jnp.zeros(d)), layers=[
            dict(ln1=(jnp.ones(d), jnp.zeros(d)), qkv=normal((d, 3 * d)), qkv_b=jnp.zeros(3 * d), proj=normal((d, d)),
                 proj_b=jnp.zeros(d), ln2=(jnp.ones(d), jnp.zeros(d)), fc=normal((d, 4 * d)), fc_b=jnp.zeros(4 * d),
                 out=normal((4 * d, d)), out_b=jnp.zeros(d)) for _ in range(c["layers"])])

        def loss(p, batch):
            ids, targets = batch["ids"], batch["targets"]
            b, t = ids.shape
            x = p["wte"][ids] + p["wpe"][:t]
            table = jnp.where(jnp.arange(t)[None, :] > jnp.arange(t)[:, None], -jnp.inf, 0.0)
            for l in p["layers"]:
                qkv = mm(ln(x, *l["ln1"], c["eps"]), l["qkv"]) + l["qkv_b"].astype(bf)
                q, k, v = (heads(qkv[..., i * d:(i + 1) * d], c["heads"]) for i in range(3))
                s = jnp.matmul(q, k.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(hd) + table
                a = jnp.matmul(softmax(s).astype(bf), v)
                x = x + mm(merge(a), l["proj"]) + l["proj_b"].astype(bf)
                m = jax.nn.gelu(mm(ln(x, *l["ln2"], c["eps"]), l["fc"]) + l["fc_b"].astype(bf), approximate=True)
                x = x + mm(m, l["out"]) + l["out_b"].astype(bf)
            h = ln(x, *p["lnf"], c["eps"]).reshape(b * t, d)
            return jnp.mean(ce_onehot(mm(h, p["wte"].T), targets))
    elif name == "bert":
        hd = d // c["heads"]
        lin = lambda i, o: (normal((i, o)), jnp.zeros(o))  # noqa: E731
        p = dict(word=normal((c["vocab"], d)), pos=normal((c["seq"], d)), typ=normal((c["types"], d)),
                 eln=(jnp.ones(d), jnp.zeros(d)), layers=[
                     dict(q=lin(d, d), k=lin(d, d), v=lin(d, d), o=lin(d, d), aln=(jnp.ones(d), jnp.zeros(d)),
                          i=lin(d, c["ffn"]), out=lin(c["ffn"], d), oln=(jnp.ones(d), jnp.zeros(d)))
                     for _ in range(c["layers"])],
                 mlm=lin(d, d), mln=(jnp.ones(d), jnp.zeros(d)), mlm_bias=jnp.zeros(c["vocab"]))

        def dense(x, wb):
            return mm(x, wb[0]) + wb[1].astype(bf)

        def loss(p, batch):
            ids, mask = batch["ids"], batch["mask"]
            b, s = ids.shape
            x = ln(p["word"][ids] + p["pos"][:s] + p["typ"][batch["types"]], *p["eln"], c["eps"])
            ext = (1.0 - mask.astype(jnp.float32))[:, None, None, :] * -10000.0
            for l in p["layers"]:
                q, k, v = (heads(dense(x, l[n]), c["heads"]) for n in ("q", "k", "v"))
                sc = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
                a = jnp.matmul(softmax(sc.astype(jnp.float32) + ext).astype(bf), v)
                x = ln(x + dense(merge(a), l["o"]), *l["aln"], c["eps"])
                x = ln(x + dense(jax.nn.gelu(dense(x, l["i"]), approximate=False), l["out"]), *l["oln"], c["eps"])
            h = x.reshape(b * s, d)
            tr = ln(jax.nn.gelu(dense(h, p["mlm"]), approximate=False), *p["mln"], c["eps"])
            logits = mm(tr, p["word"].T).astype(jnp.float32) + p["mlm_bias"]
            z = logits
            m = jnp.max(z, -1, keepdims=True)
            lse = (jnp.log(jnp.sum(jnp.exp(z - m), -1, keepdims=True)) + m).reshape(-1)
            picked = jnp.sum(z * jax.nn.one_hot(batch["labels"], c["vocab"], dtype=jnp.float32), -1)
            w = batch["weights"]
            return jnp.sum((lse - picked) * w) / jnp.sum(w)
    else:  # t5
        inner = c["heads"] * c["d_kv"]
        attn = lambda: dict(q=normal((d, inner)), k=normal((d, inner)), v=normal((d, inner)), o=normal((inner, d)))  # noqa: E731
        ff = lambda: dict(wi0=normal((d, c["ffn"])), wi1=normal((d, c["ffn"])), wo=normal((c["ffn"], d)))  # noqa: E731
        p = dict(shared=normal((c["vocab"], d), 1.0),
                 enc=dict(rel=normal((c["buckets"], c["heads"]), 0.5), final=jnp.ones(d),
                          blocks=[dict(n1=jnp.ones(d), sa=attn(), n2=jnp.ones(d), ff=ff()) for _ in range(c["layers"])]),
                 dec=dict(rel=normal((c["buckets"], c["heads"]), 0.5), final=jnp.ones(d),
                          blocks=[dict(n1=jnp.ones(d), sa=attn(), nc=jnp.ones(d), ca=attn(), n2=jnp.ones(d), ff=ff())
                                  for _ in range(c["dec_layers"])]))
        enc_b = jnp.asarray(t5_buckets(c["seq"], c["seq"], True, c))
        dec_b = jnp.asarray(t5_buckets(c["tgt"], c["tgt"], False, c))

        def attend(a, x, kv, keep, bias):
            q, k, v = heads(mm(x, a["q"]), c["heads"]), heads(mm(kv, a["k"]), c["heads"]), heads(mm(kv, a["v"]), c["heads"])
            s = jnp.matmul(q, k.transpose(0, 1, 3, 2)).astype(jnp.float32)
            if bias is not None:
                s = s + bias
            s = jnp.where(keep, s, jnp.finfo(jnp.float32).min)
            return mm(merge(jnp.matmul(softmax(s).astype(bf), v)), a["o"])

        def ffn(f, x):
            return mm(jax.nn.gelu(mm(x, f["wi0"]), approximate=True) * mm(x, f["wi1"]), f["wo"])

        def loss(p, batch):
            ids, labels = batch["ids"], batch["labels"]
            b, s = ids.shape
            t = labels.shape[1]
            keep_e = (batch["mask"] != 0)[:, None, None, :]
            x = p["shared"][ids]
            eb = p["enc"]["rel"][enc_b].transpose(2, 0, 1)[None]
            for blk in p["enc"]["blocks"]:
                n = rms(x, blk["n1"], c["eps"])
                x = x + attend(blk["sa"], n, n, keep_e, eb)
                x = x + ffn(blk["ff"], rms(x, blk["n2"], c["eps"]))
            enc = rms(x, p["enc"]["final"], c["eps"])
            dec_ids = jnp.concatenate([jnp.zeros((b, 1), labels.dtype), labels[:, :-1]], 1)
            causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
            keep_d = causal[None, None] & (batch["label_mask"] != 0)[:, None, None, :]
            db = p["dec"]["rel"][dec_b].transpose(2, 0, 1)[None]
            y = p["shared"][dec_ids]
            for blk in p["dec"]["blocks"]:
                n = rms(y, blk["n1"], c["eps"])
                y = y + attend(blk["sa"], n, n, keep_d, db)
                y = y + attend(blk["ca"], rms(y, blk["nc"], c["eps"]), enc, keep_e, None)
                y = y + ffn(blk["ff"], rms(y, blk["n2"], c["eps"]))
            h = rms(y, p["dec"]["final"], c["eps"]) * (d ** -0.5)
            nll = ce_onehot(mm(h.reshape(b * t, d), p["shared"].T), labels.reshape(-1))
            w = batch["label_mask"].reshape(-1).astype(jnp.float32)
            return jnp.sum(nll * w) / jnp.sum(w)

    opt = optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    state = opt.init(p)

    @jax.jit
    def step(p, state, batch):
        l, g = jax.value_and_grad(loss)(p, batch)
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state, l

    batch = {k: jnp.asarray(v) for k, v in data(name, c, np.random.default_rng(0)).items()}
    t0 = time.perf_counter()
    compiled = step.lower(p, state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    losses = []
    for _ in range(3):
        p, state, l = compiled(p, state, batch)
        losses.append(float(l))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        p, state, l = compiled(p, state, batch)
        l.block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(ms=statistics.median(times), compile_s=compile_s, losses=losses,
                temp_bytes=getattr(mem, "temp_size_in_bytes", None))


# ----------------------------------------------------------------------------- PyTorch

def time_torch_steps(step, iters):
    """PyTorch's measure: the first step (its compile), two more, then the
    median of `iters` steps timed by CUDA events, and the peak memory over
    them."""
    import torch

    t0 = time.perf_counter()
    losses = [float(step())]
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    losses += [float(step()) for _ in range(2)]
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return dict(ms=statistics.median(times), compile_s=compile_s, losses=losses,
                peak_bytes=torch.cuda.max_memory_allocated())


def run_torch(name, c, iters):
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    torch.manual_seed(0)
    bf = torch.bfloat16
    d = c["dim"]

    def P(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape, device=dev) * std)

    def ones(n):
        return torch.nn.Parameter(torch.ones(n, device=dev))

    def zeros(n):
        return torch.nn.Parameter(torch.zeros(n, device=dev))

    def rms(x, g, eps):
        x32 = x.float()
        return g * (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps))

    def ln(x, g, b, eps):
        x = x.float()
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(v + eps) * g + b

    def softmax(s):
        s = s.float()
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def heads(x, n):
        b, t, _ = x.shape
        return x.view(b, t, n, -1).transpose(1, 2)

    def merge(x):
        b, h, t, hd = x.shape
        return x.transpose(1, 2).reshape(b, t, h * hd)

    def ce_onehot(logits, labels):
        logp = F.log_softmax(logits.float(), -1)
        return -(logp * F.one_hot(labels.long(), logits.shape[-1]).float()).sum(-1)

    ps = torch.nn.ParameterList()

    def reg(x):
        ps.append(x)
        return x

    if name == "llama":
        hd = d // c["heads"]
        kvd = c["kv_heads"] * hd
        embed = reg(P(c["vocab"], d))
        norm = reg(ones(d))
        L = [dict(an=reg(ones(d)), wq=reg(P(d, d)), wk=reg(P(d, kvd)), wv=reg(P(d, kvd)), wo=reg(P(d, d)),
                  mn=reg(ones(d)), gate=reg(P(d, c["ffn"])), up=reg(P(d, c["ffn"])), down=reg(P(c["ffn"], d)))
             for _ in range(c["layers"])]

        def rope(x, cos, sin):
            h = x.shape[-1] // 2
            a, b2 = x[..., :h], x[..., h:]
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            return torch.cat([a * cos - b2 * sin, b2 * cos + a * sin], -1)

        def loss(batch):
            ids, targets = batch["ids"], batch["targets"]
            b, t = ids.shape
            half = hd // 2
            inv = c["theta"] ** (-(2 * torch.arange(half, device=dev)) / (2 * half))
            ang = torch.arange(t, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
            cos, sin = torch.cos(ang), torch.sin(ang)
            x = embed[ids]
            causal = torch.arange(t, device=dev)[:, None] >= torch.arange(t, device=dev)[None, :]
            g = c["heads"] // c["kv_heads"]
            for l in L:
                n = rms(x, l["an"], c["eps"])
                q = rope(heads(n @ l["wq"], c["heads"]), cos, sin)
                k = rope(heads(n @ l["wk"], c["kv_heads"]), cos, sin)
                v = heads(n @ l["wv"], c["kv_heads"])
                k = k[:, :, None].expand(b, c["kv_heads"], g, t, hd).reshape(b, c["heads"], t, hd)
                v = v[:, :, None].expand(b, c["kv_heads"], g, t, hd).reshape(b, c["heads"], t, hd)
                s = (q @ k.transpose(2, 3)) * (1.0 / math.sqrt(hd))
                s = torch.where(causal, s, torch.tensor(-1e9, dtype=s.dtype, device=dev))
                x = x + merge(softmax(s).to(v.dtype) @ v) @ l["wo"]
                n = rms(x, l["mn"], c["eps"])
                gt = n @ l["gate"]
                x = x + (gt * torch.sigmoid(gt) * (n @ l["up"])) @ l["down"]
            h = rms(x, norm, c["eps"]).reshape(b * t, d)
            return ce_onehot(h @ embed.t(), targets).mean()
    elif name == "gpt2":
        hd = d // c["heads"]
        wte, wpe = reg(P(c["vocab"], d)), reg(P(c["seq"], d, std=0.01))
        lnf = (reg(ones(d)), reg(zeros(d)))
        L = [dict(ln1=(reg(ones(d)), reg(zeros(d))), qkv=reg(P(d, 3 * d)), qkv_b=reg(zeros(3 * d)), proj=reg(P(d, d)),
                  proj_b=reg(zeros(d)), ln2=(reg(ones(d)), reg(zeros(d))), fc=reg(P(d, 4 * d)), fc_b=reg(zeros(4 * d)),
                  out=reg(P(4 * d, d)), out_b=reg(zeros(d))) for _ in range(c["layers"])]

        def loss(batch):
            ids, targets = batch["ids"], batch["targets"]
            b, t = ids.shape
            x = wte[ids] + wpe[:t]
            ar = torch.arange(t, device=dev)
            table = torch.zeros(t, t, device=dev).masked_fill(ar[None, :] > ar[:, None], float("-inf"))
            for l in L:
                qkv = ln(x, *l["ln1"], c["eps"]) @ l["qkv"] + l["qkv_b"]
                q, k, v = (heads(qkv[..., i * d:(i + 1) * d], c["heads"]) for i in range(3))
                s = (q @ k.transpose(-1, -2)).float() / math.sqrt(hd) + table
                x = x + merge(softmax(s).to(v.dtype) @ v) @ l["proj"] + l["proj_b"]
                m = F.gelu(ln(x, *l["ln2"], c["eps"]) @ l["fc"] + l["fc_b"], approximate="tanh")
                x = x + m @ l["out"] + l["out_b"]
            h = ln(x, *lnf, c["eps"]).reshape(b * t, d)
            return ce_onehot(h @ wte.t(), targets).mean()
    elif name == "bert":
        hd = d // c["heads"]

        def lin(i, o):
            return (reg(P(i, o)), reg(zeros(o)))

        word, pos, typ = reg(P(c["vocab"], d)), reg(P(c["seq"], d)), reg(P(c["types"], d))
        eln = (reg(ones(d)), reg(zeros(d)))
        L = [dict(q=lin(d, d), k=lin(d, d), v=lin(d, d), o=lin(d, d), aln=(reg(ones(d)), reg(zeros(d))),
                  i=lin(d, c["ffn"]), out=lin(c["ffn"], d), oln=(reg(ones(d)), reg(zeros(d)))) for _ in range(c["layers"])]
        mlm, mln, mlm_bias = lin(d, d), (reg(ones(d)), reg(zeros(d))), reg(zeros(c["vocab"]))

        def dense(x, wb):
            return x @ wb[0] + wb[1]

        def loss(batch):
            ids, mask = batch["ids"], batch["mask"]
            b, s = ids.shape
            x = ln(word[ids] + pos[:s] + typ[batch["types"]], *eln, c["eps"])
            ext = (1.0 - mask.float())[:, None, None, :] * -10000.0
            for l in L:
                q, k, v = (heads(dense(x, l[n]), c["heads"]) for n in ("q", "k", "v"))
                sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                x = ln(x + dense(merge(softmax(sc.float() + ext).to(v.dtype) @ v), l["o"]), *l["aln"], c["eps"])
                x = ln(x + dense(F.gelu(dense(x, l["i"])), l["out"]), *l["oln"], c["eps"])
            h = x.reshape(b * s, d)
            tr = ln(F.gelu(dense(h, mlm)), *mln, c["eps"])
            z = (tr @ word.t()).float() + mlm_bias
            m = z.amax(-1, keepdim=True)
            lse = (torch.log(torch.exp(z - m).sum(-1, keepdim=True)) + m).reshape(-1)
            picked = (z * F.one_hot(batch["labels"].long(), c["vocab"]).float()).sum(-1)
            w = batch["weights"]
            return ((lse - picked) * w).sum() / w.sum()
    else:  # t5
        inner = c["heads"] * c["d_kv"]

        def attn():
            return dict(q=reg(P(d, inner)), k=reg(P(d, inner)), v=reg(P(d, inner)), o=reg(P(inner, d)))

        def ff():
            return dict(wi0=reg(P(d, c["ffn"])), wi1=reg(P(d, c["ffn"])), wo=reg(P(c["ffn"], d)))

        shared = reg(P(c["vocab"], d, std=1.0))
        enc = dict(rel=reg(P(c["buckets"], c["heads"], std=0.5)), final=reg(ones(d)),
                   blocks=[dict(n1=reg(ones(d)), sa=attn(), n2=reg(ones(d)), ff=ff()) for _ in range(c["layers"])])
        dec = dict(rel=reg(P(c["buckets"], c["heads"], std=0.5)), final=reg(ones(d)),
                   blocks=[dict(n1=reg(ones(d)), sa=attn(), nc=reg(ones(d)), ca=attn(), n2=reg(ones(d)), ff=ff())
                           for _ in range(c["dec_layers"])])
        enc_b = torch.as_tensor(t5_buckets(c["seq"], c["seq"], True, c), device=dev).long()
        dec_b = torch.as_tensor(t5_buckets(c["tgt"], c["tgt"], False, c), device=dev).long()
        lowest = torch.finfo(torch.float32).min

        def attend(a, x, kv, keep, bias):
            q, k, v = heads(x @ a["q"], c["heads"]), heads(kv @ a["k"], c["heads"]), heads(kv @ a["v"], c["heads"])
            s = (q @ k.transpose(3, 2)).float()
            if bias is not None:
                s = s + bias
            s = torch.where(keep, s, torch.tensor(lowest, device=dev))
            return merge(softmax(s).to(v.dtype) @ v) @ a["o"]

        def ffn(f, x):
            return (F.gelu(x @ f["wi0"], approximate="tanh") * (x @ f["wi1"])) @ f["wo"]

        def loss(batch):
            ids, labels = batch["ids"], batch["labels"]
            b, s = ids.shape
            t = labels.shape[1]
            keep_e = (batch["mask"] != 0)[:, None, None, :]
            x = shared[ids]
            eb = enc["rel"][enc_b].permute(2, 0, 1)[None]
            for blk in enc["blocks"]:
                n = rms(x, blk["n1"], c["eps"])
                x = x + attend(blk["sa"], n, n, keep_e, eb)
                x = x + ffn(blk["ff"], rms(x, blk["n2"], c["eps"]))
            e = rms(x, enc["final"], c["eps"])
            dec_ids = torch.cat([torch.zeros(b, 1, dtype=labels.dtype, device=dev), labels[:, :-1]], 1)
            ar = torch.arange(t, device=dev)
            keep_d = (ar[None, :] <= ar[:, None])[None, None] & (batch["label_mask"] != 0)[:, None, None, :]
            db = dec["rel"][dec_b].permute(2, 0, 1)[None]
            y = shared[dec_ids]
            for blk in dec["blocks"]:
                n = rms(y, blk["n1"], c["eps"])
                y = y + attend(blk["sa"], n, n, keep_d, db)
                y = y + attend(blk["ca"], rms(y, blk["nc"], c["eps"]), e, keep_e, None)
                y = y + ffn(blk["ff"], rms(y, blk["n2"], c["eps"]))
            h = rms(y, dec["final"], c["eps"]) * (d ** -0.5)
            nll = ce_onehot(h.reshape(b * t, d) @ shared.t(), labels.reshape(-1))
            w = batch["label_mask"].reshape(-1).float()
            return (nll * w).sum() / w.sum()

    opt = torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    compiled = torch.compile(loss)
    batch = {k: torch.as_tensor(v, device=dev) for k, v in data(name, c, np.random.default_rng(0)).items()}

    def step():
        with torch.autocast("cuda", dtype=bf):
            l = compiled(batch)
        l.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return l

    return time_torch_steps(step, iters)


def run_hf(name, c, iters):
    import os

    # This folder's `kernels.py` would shadow the `kernels` package that
    # transformers imports: leave the folder off the path for it.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    import transformers as tf

    dev = "cuda"
    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=c["vocab"], hidden_size=c["dim"], num_hidden_layers=c["layers"],
                             num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                             intermediate_size=c["ffn"], rms_norm_eps=c["eps"], rope_theta=c["theta"],
                             max_position_embeddings=c["seq"], tie_word_embeddings=True)
        model = tf.LlamaForCausalLM(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=c["vocab"], n_embd=c["dim"], n_layer=c["layers"], n_head=c["heads"],
                            n_positions=c["seq"], layer_norm_epsilon=c["eps"], resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=c["vocab"], hidden_size=c["dim"], num_hidden_layers=c["layers"],
                            num_attention_heads=c["heads"], intermediate_size=c["ffn"], type_vocab_size=c["types"],
                            max_position_embeddings=c["seq"], layer_norm_eps=c["eps"], hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        model = tf.BertForMaskedLM(cfg)
    else:
        cfg = tf.T5Config(vocab_size=c["vocab"], d_model=c["dim"], d_kv=c["d_kv"], num_heads=c["heads"],
                          d_ff=c["ffn"], num_layers=c["layers"], num_decoder_layers=c["dec_layers"],
                          relative_attention_num_buckets=c["buckets"], relative_attention_max_distance=c["max_dist"],
                          feed_forward_proj="relu", dropout_rate=0.0, layer_norm_epsilon=c["eps"],
                          decoder_start_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
    model = model.to(dev).train()
    raw = {k: torch.as_tensor(v, device=dev) for k, v in data(name, c, np.random.default_rng(0)).items()}
    if name in ("llama", "gpt2"):
        ids = raw["ids"].long()
        batch = dict(input_ids=ids, labels=ids)
    elif name == "bert":
        labels = raw["labels"].long().view(c["batch"], c["seq"])
        labels = torch.where(raw["weights"].view(c["batch"], c["seq"]) > 0, labels, -100)
        batch = dict(input_ids=raw["ids"].long(), token_type_ids=raw["types"].long(),
                     attention_mask=raw["mask"].long(), labels=labels)
    else:
        batch = dict(input_ids=raw["ids"].long(), attention_mask=raw["mask"].long(), labels=raw["labels"].long())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    compiled = torch.compile(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            l = compiled(**batch).loss
        l.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return l

    r = time_torch_steps(step, iters)
    r.update(transformers=tf.__version__, attention=model.config._attn_implementation)
    return r


def main():
    framework, name = sys.argv[1], sys.argv[2]
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    c = CONFIGS[name]
    r = {"jax": run_jax, "torch": run_torch, "hf": run_hf}[framework](name, c, iters)
    r.update(system=framework, model=name, tokens_per_s=tokens(name, c) / (r["ms"] / 1e3))
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
