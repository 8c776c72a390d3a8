"""The MLP's backward with kernels of kiln's own: could a Triton kernel make a
recomputation cheaper than XLA's cuBLAS GEMMs plus its GELU kernel?

gpt2-small's MLP on 8192 tokens (d 768, hidden 3072), bf16. Times (us, Triton's
do_bench) of: cuBLAS for the up-projection `h = x W + b` and for `dg = dy W2^T`;
an elementwise GELU backward that reads dg and h and writes dh and gelu(h);
and Triton GEMMs over a few tile shapes: MODE 0 dg alone, 1 dg with the GELU
backward in its epilogue (h read from memory), 3 both GEMMs in one kernel (two
accumulators) with plain stores, 2 both GEMMs with the GELU backward in the
epilogue (h never written). APPROX=1 computes tanh with `tanh.approx.f32`.

    python3 mlp_triton_probe.py        # on the device (H100)

Results: benches/RESULTS.md, "kiln's own kernels for the MLP's backward".
"""
import os, torch, triton, triton.language as tl
from triton.testing import do_bench
C = tl.constexpr(0.7978845608028654)
A = tl.constexpr(0.044715)

APPROX = os.environ.get('APPROX') == '1'
if APPROX:
    @triton.jit
    def _tanh(x):
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
else:
    @triton.jit
    def _tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)

@triton.jit
def gemm_kernel(a_ptr, b_ptr, c_ptr, h_ptr, g_ptr, x2_ptr, w2_ptr, bias_ptr, M, N, K,
                MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # a [M,K] row-major, b [K,N] row-major (b2 likewise); MODE 0: plain; 1: epilogue with saved h; 2: dual
    pid = tl.program_id(0)
    npm = tl.cdiv(M, BM); npn = tl.cdiv(N, BN)
    width = GROUP * npn
    gid = pid // width
    first = gid * GROUP
    gs = min(npm - first, GROUP)
    pm = first + (pid % width) % gs
    pn = (pid % width) // gs
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
        if MODE >= 2:
            a2 = tl.load(x2_ptr + rm[:, None] * K + (k + rk)[None, :])
            b2 = tl.load(w2_ptr + (k + rk)[:, None] * N + rn[None, :])
            acc2 = tl.dot(a2, b2, acc2)
    off = rm[:, None] * N + rn[None, :]
    if MODE == 0:
        tl.store(c_ptr + off, acc.to(tl.bfloat16))
    elif MODE == 3:
        tl.store(c_ptr + off, acc.to(tl.bfloat16))
        tl.store(g_ptr + off, acc2.to(tl.bfloat16))
    else:
        dg = acc.to(tl.bfloat16).to(tl.float32)
        if MODE == 1:
            h = tl.load(h_ptr + off).to(tl.float32)
        else:
            bias = tl.load(bias_ptr + rn).to(tl.float32)
            h = (acc2 + bias[None, :]).to(tl.bfloat16).to(tl.float32)
        u = C * (h + A * h * h * h)
        t = _tanh(u)
        gel = 0.5 * h * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * C * (1.0 + 3.0 * A * h * h)
        tl.store(c_ptr + off, (dg * d).to(tl.bfloat16))
        tl.store(g_ptr + off, gel.to(tl.bfloat16))

@triton.jit
def gelu_bwd_kernel(dg_ptr, h_ptr, dh_ptr, g_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dg = tl.load(dg_ptr + o).to(tl.float32)
    h = tl.load(h_ptr + o).to(tl.float32)
    u = C * (h + A * h * h * h)
    t = _tanh(u)
    d = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * C * (1.0 + 3.0 * A * h * h)
    tl.store(dh_ptr + o, (dg * d).to(tl.bfloat16))
    tl.store(g_ptr + o, (0.5 * h * (1.0 + t)).to(tl.bfloat16))

M, K, N = 8192, 768, 3072
torch.manual_seed(0)
bf = torch.bfloat16
x = torch.randn(M, K, device='cuda', dtype=bf)
dy = torch.randn(M, K, device='cuda', dtype=bf) * 0.1
wfc = (torch.randn(K, N, device='cuda') * 0.03).to(bf)
wfc2t = (torch.randn(K, N, device='cuda') * 0.03).to(bf)   # W_fc2^T laid out [K,N]
bias = (torch.randn(N, device='cuda') * 0.1).to(bf)
h = (x @ wfc + bias)
dg = dy @ wfc2t
out = torch.empty(M, N, device='cuda', dtype=bf); gout = torch.empty_like(out)

res = {}
res['cublas_upproj'] = do_bench(lambda: torch.addmm(bias, x, wfc), warmup=50, rep=300)
res['cublas_dg'] = do_bench(lambda: torch.mm(dy, wfc2t), warmup=50, rep=300)
BL = 4096
res['triton_gelu_bwd_elementwise'] = do_bench(lambda: gelu_bwd_kernel[(M * N // BL,)](dg, h, out, gout, M * N, BLOCK=BL, num_warps=8), warmup=50, rep=300)
ref_dh, ref_g = out.clone(), gout.clone()

def run(mode, BM, BN, BK, w, s):
    grid = ((M // BM) * (N // BN),)
    return lambda: gemm_kernel[grid](dy, wfc2t, out, h, gout, x, wfc, bias, M, N, K, MODE=mode, BM=BM, BN=BN, BK=BK, GROUP=8, num_warps=w, num_stages=s)

cfgs = [(128,128,64,8,3),(128,256,64,8,3),(128,128,32,8,4),(128,128,64,8,2),(128,64,64,4,3),(64,128,64,4,3),(128,128,32,4,4),(128,256,32,8,3),(128,128,64,4,2)]
for mode, name in [(0,'triton_plain_dg'),(1,'triton_dg_epilogue_saved_h'),(3,'triton_dual_noepi'),(2,'triton_dual')]:
    best = None
    for c in cfgs:
        try:
            f = run(mode, *c); f(); torch.cuda.synchronize()
            t = do_bench(f, warmup=30, rep=200)
        except Exception as e:
            print(name, c, 'failed', str(e)[:200]); continue
        print(name, c, round(t*1000,1), 'us', flush=True)
        if best is None or t < best[0]: best = (t, c)
    res[name] = best[0]; res[name+'_cfg'] = best[1]
    f = run(mode, *best[1]); f(); torch.cuda.synchronize()
    if mode in (1, 2):
        print(name, 'dh err', (out.float()-ref_dh.float()).abs().max().item(), 'ref max', ref_dh.float().abs().max().item(),
              'gelu err', (gout.float()-ref_g.float()).abs().max().item())
for k,v in res.items():
    print(k, (round(v*1000,1) if isinstance(v,float) else v))
