# Bisects the slow CUDA-plugin compile of kiln's flat gpt2-small init program:
# the text cut after a value, that value the only output, compiled through
# JAX's client of the same plugin.
import re, sys, time
from jax._src import xla_bridge as xb
from jax._src.lib import xla_client as xc
backend = xb.get_backend("cuda")
devs = backend.local_devices()[:1]
text = open(sys.argv[1]).read()
lines = text.split("\n")
fi = next(i for i, l in enumerate(lines) if "func.func public @main" in l)
head = lines[fi].split(") -> (", 1)[0]
def cut(value, ty):
    di = next(i for i, l in enumerate(lines) if l.strip().startswith(value + " = "))
    body = lines[fi + 1:di + 1]
    return "\n".join(lines[:fi] + [head + ") -> (" + ty + ") {"] + body + [f"    return {value} : {ty}", "  }", "}"])
N = "124354560"
for value, ty, what in [
    ("%v82", f"tensor<{N}xui64>", "lane 0 integers: iota, SplitMix64 mix, >> 11"),
    ("%v92", f"tensor<{N}xf64>", "+ lane 0 floats: sqrt(-2 log(1 - u1))"),
    ("%v112", f"tensor<{N}xf64>", "+ lane 1: r * cos(2 pi u2)"),
    ("%v116", f"tensor<{N}xf64>", "+ first compare of the std chain (output: a std broadcast)"),
]:
    t0 = time.perf_counter()
    try:
        backend.compile_and_load(cut(value, ty), xc.DeviceList(tuple(devs)), xc.CompileOptions())
        print(f"cut at {value:6s} ({what:58s}) compile {1e3*(time.perf_counter()-t0):9.1f} ms", flush=True)
    except Exception as e:
        print(f"cut at {value}: failed {repr(e)[:300]}", flush=True)
