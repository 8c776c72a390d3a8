# Compiles kiln's init-program StableHLO text (written by
# `init_setup --lower`) through JAX's client of the same CUDA plugin, timing
# the MLIR parse and the compile apart: is the time in the text or in how
# kiln calls the plugin?
import sys, time
import jax
from jax._src import xla_bridge as xb
from jax._src.lib import xla_client as xc
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
jax.config.update("jax_enable_x64", True)
backend = xb.get_backend("cuda")
devs = backend.local_devices()[:1]
def compile_text(text):
    opts = xc.CompileOptions()
    errs = []
    for call in (lambda: backend.compile_and_load(text, xc.DeviceList(tuple(devs)), opts),
                 lambda: backend.compile_and_load(text, devs, opts),
                 lambda: backend.compile(text, opts)):
        try:
            return call()
        except Exception as e:  # try the next signature
            errs.append(repr(e)[:300])
    raise RuntimeError(" | ".join(errs))
for path in sys.argv[1:]:
    text = open(path).read()
    with mlir.make_ir_context() as ctx:
        t0 = time.perf_counter(); m = ir.Module.parse(text); t1 = time.perf_counter()
        bc = mlir.module_to_bytecode(m)
    t2 = time.perf_counter()
    try:
        compile_text(text); t3 = time.perf_counter()
        compile_text(bc); t4 = time.perf_counter()
        print(f"{path}: parse {1e3*(t1-t0):.1f} ms, compile(text) {1e3*(t3-t2):.1f} ms, compile(bytecode) {1e3*(t4-t3):.1f} ms", flush=True)
    except Exception as e:
        print(f"{path}: parse {1e3*(t1-t0):.1f} ms, compile failed: {e}", flush=True)
