"""How much host copies on a side stream slow a gpt2-small training step.

The route "copies of kiln's own" (docs/memory-journal.md, "What copies that cost
nothing could take off the greedy plans") assumes copies to and from pinned
host memory that overlap the kernels cost the step nothing. This measures it
on a PyTorch gpt2-small step (the peers' definition, bf16 autocast, SDPA;
B8 x T1024, through torch.compile unless "eager"): the step alone, and the
step with MB megabytes copied device-to-host and as many host-to-device on two
other streams, issued at the step's start in 12 MiB pieces (a layer's
projection output), joined before the next step. The settings run in turn,
REPS rounds of 30 steps each; prints each setting's median round.

usage: python3 copy_interference.py PEERS_DIR MB[,MB...] [REPS] [eager|compile|graphs]
(MB 0 is the step alone. Eager PyTorch leaves the GPU idle between launches,
which copies then fill; "graphs" replays the compiled step as CUDA graphs,
the least host time between kernels, like kiln's captured step.)
"""
import statistics, sys, time

sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
from peers import GPT

SIZES = [int(x) for x in sys.argv[2].split(",")]
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 10
MODE = sys.argv[4] if len(sys.argv) > 4 else "compile"
EAGER = MODE == "eager"
dev = "cuda"
torch.manual_seed(0)
m = GPT().to(dev)
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
idx = torch.randint(0, 50257, (8, 1024), device=dev)
tgt = torch.randint(0, 50257, (8, 1024), device=dev)


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = m(idx, True)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
    loss.backward()
    opt.step()


if MODE == "graphs":
    step = torch.compile(step, mode="reduce-overhead")
elif not EAGER:
    step = torch.compile(step)

piece = 12 << 20
n_max = max(SIZES) // 12 + 1
dev_src = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(n_max)]
dev_dst = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(n_max)]
host_out = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(n_max)]
host_in = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(n_max)]
side_out, side_in = torch.cuda.Stream(), torch.cuda.Stream()


def copies(n):
    main = torch.cuda.current_stream()
    for s in (side_out, side_in):
        s.wait_stream(main)
    with torch.cuda.stream(side_out):
        for d, h in zip(dev_src[:n], host_out[:n]):
            h.copy_(d, non_blocking=True)
    with torch.cuda.stream(side_in):
        for h, d in zip(host_in[:n], dev_dst[:n]):
            d.copy_(h, non_blocking=True)


def join():
    main = torch.cuda.current_stream()
    main.wait_stream(side_out)
    main.wait_stream(side_in)


def run(mb, iters=30, with_step=True):
    n = mb // 12
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        if n:
            copies(n)
        if with_step:
            step()
        if n:
            join()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


for _ in range(5):
    step()
rounds = {mb: [] for mb in SIZES}
for _ in range(REPS):
    for mb in SIZES:
        rounds[mb].append(run(mb))
print(f"step: {MODE}; {REPS} rounds of 30 steps per setting, in turn")
base = statistics.median(rounds[SIZES[0]])
for mb in SIZES:
    med = statistics.median(rounds[mb])
    alone = run(mb, with_step=False) if mb else 0.0
    print(
        f"{mb // 12 * 12:4d} MiB each way (copies alone {alone:.3f} ms): step {med:.3f} ms ({(med / base - 1) * 100:+.2f}%)"
        f"  min {min(rounds[mb]):.3f}  rounds {[round(x, 2) for x in rounds[mb]]}"
    )
