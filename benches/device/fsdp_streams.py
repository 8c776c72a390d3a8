"""Per-step time of a multi-GPU step by stream, from a ktrace.so trace (TSV:
kind, start ns, end ns, stream, name) of one process driving several GPUs.

Each GPU's compute stream is one of the COMPUTE busiest streams (default 2).
For each, the step's launch count is found from the tail of that stream alone
(a kernel name whose last occurrences are equally spaced), and the last NSTEP
steps are averaged: wall time, busy time, time in NCCL kernels on the compute
stream (collectives that did not overlap compute) and by kind, and the busy
time of the other streams inside the last step's window.

Usage: fsdp_streams.py TRACE [NSTEP] [COMPUTE]"""
import collections
import sys

path = sys.argv[1]
nstep = int(sys.argv[2]) if len(sys.argv) > 2 else 5
ncompute = int(sys.argv[3]) if len(sys.argv) > 3 else 2
rows = []
for line in open(path, errors="replace"):
    p = line.rstrip("\n").split("\t")
    if len(p) < 5 or p[0] != "K":
        continue
    rows.append((int(p[1]), int(p[2]), p[3], p[4]))
rows.sort()
count = collections.Counter(r[2] for r in rows)
for cs, _ in count.most_common(ncompute):
    r = [x for x in rows if x[2] == cs]
    names = [x[3] for x in r]
    pos = collections.defaultdict(list)
    for i, n in enumerate(names):
        pos[n].append(i)
    cand = collections.Counter()
    for n in set(names[-200:]):
        p = pos[n][-5:]
        if len(p) >= 4:
            d = {p[i + 1] - p[i] for i in range(len(p) - 1)}
            if len(d) == 1 and min(d) >= 100:
                cand[d.pop()] += 1
    if not cand:
        print(f"stream {cs}: no period found")
        continue
    L = cand.most_common(1)[0][0]
    n = min(nstep, len(r) // L)
    steps = [r[len(r) - (k + 1) * L : len(r) - k * L] for k in range(n)]
    mean = lambda xs: sum(xs) / n / 1e3
    wall = mean([s[-1][1] - s[0][0] for s in steps])
    busy = mean([sum(x[1] - x[0] for x in s) for s in steps])
    nccl = mean([sum(x[1] - x[0] for x in s if "nccl" in x[3].lower()) for s in steps])
    print(f"stream {cs}: {L} launches a step, last {n} steps: wall {wall:.0f} us, busy {busy:.0f} us, "
          f"NCCL on this stream {nccl:.0f} us")
    kinds = collections.defaultdict(lambda: [0, 0])
    for s in steps:
        for x in s:
            if "nccl" in x[3].lower():
                kinds[x[3][:60]][0] += 1
                kinds[x[3][:60]][1] += x[1] - x[0]
    for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:6]:
        print(f"   {c / n:.0f} x {k}: {t / n / 1e3:.0f} us")
    t0, t1 = steps[0][0][0], steps[0][-1][1]
    other = collections.defaultdict(float)
    for x in rows:
        if x[2] != cs and x[0] >= t0 and x[1] <= t1:
            other[x[2]] += (x[1] - x[0]) / 1e3
    print("   other streams in the last step's window (us):", {k: round(v) for k, v in sorted(other.items())})
