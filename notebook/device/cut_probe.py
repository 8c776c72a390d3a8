# Cuts kiln's gpt2-small flat init program (its StableHLO text) into parts
# and compiles each through JAX's client of the CUDA plugin: the whole, the
# computation alone (one flat output), and the outputs alone (148 broadcasts
# of the same types): which half holds the slow compile?
import re, sys, time
import jax
from jax._src import xla_bridge as xb
from jax._src.lib import xla_client as xc
backend = xb.get_backend("cuda")
devs = backend.local_devices()[:1]
def compile_text(text):
    return backend.compile_and_load(text, xc.DeviceList(tuple(devs)), xc.CompileOptions())
text = open(sys.argv[1]).read()
lines = text.split("\n")
fi = next(i for i, l in enumerate(lines) if "func.func public @main" in l)
ri = next(i for i, l in enumerate(lines) if l.strip().startswith("return "))
head, results = lines[fi].split(") -> (", 1)
out_types = re.findall(r"tensor<[^>]*>", results.rsplit(")", 1)[0])
def program(body, ret_vals, ret_types):
    sig = head + ") -> (" + ", ".join(ret_types) + ") {"
    return "\n".join(lines[:fi] + [sig] + body + ["    return " + ", ".join(ret_vals) + " : " + ", ".join(ret_types), "  }", "}"])
variants = {}
bi = next(i for i, l in enumerate(lines) if "optimization_barrier" in l)
bar = lines[bi].split("=")[0].strip()
pre = lines[bi - 1].split("=")[0].strip()
variants["computation to the barrier, one output"] = program(lines[fi + 1:bi + 1], [bar], ["tensor<124354560xf32>"])
variants["computation without the barrier, one output"] = program(lines[fi + 1:bi], [pre], ["tensor<124354560xf32>"])
body = ["    %z = stablehlo.constant dense<0.0e0> : tensor<f32>"]
vals = []
for j, t in enumerate(out_types):
    shape = t[len("tensor<"):-1].rsplit("x", 1)[0] if "x" in t else ""
    body.append(f"    %o{j} = stablehlo.broadcast_in_dim %z, dims = [] : (tensor<f32>) -> {t}")
    vals.append(f"%o{j}")
variants[f"outputs alone ({len(out_types)} broadcasts)"] = program(body, vals, out_types)
for name, t in variants.items():
    t0 = time.perf_counter()
    try:
        compile_text(t)
        print(f"{name:45s} compile {1e3*(time.perf_counter()-t0):9.1f} ms", flush=True)
    except Exception as e:
        print(f"{name:45s} failed: {repr(e)[:400]}", flush=True)
