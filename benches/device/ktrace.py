"""Per-step kernel times from a ktrace.so trace (TSV: kind, start ns, end ns,
stream, name). The step's launch count L is found from the tail (a kernel name
whose last occurrences are equally spaced), then the last NSTEP periods are
averaged. Usage: ktrace.py LABEL TRACE [NSTEP]"""
import sys, collections, re
lab, path = sys.argv[1], sys.argv[2]
nstep = int(sys.argv[3]) if len(sys.argv) > 3 else 3
rows = []
for line in open(path, errors="replace"):
    p = line.rstrip("\n").split("\t")
    if len(p) < 5: continue
    rows.append((int(p[1]), int(p[2]), p[0], p[4]))
rows.sort()
names = [r[3] for r in rows]
pos = collections.defaultdict(list)
for i, n in enumerate(names): pos[n].append(i)
cand = collections.Counter()
for n in set(names[-80:]):
    p = pos[n][-5:]
    if len(p) >= 4:
        d = {p[i + 1] - p[i] for i in range(len(p) - 1)}
        if len(d) == 1 and min(d) >= 100: cand[d.pop()] += 1
if not cand:
    print(lab, "no period found;", len(rows), "records"); sys.exit(0)
L = cand.most_common(1)[0][0]
nstep = min(nstep, len(rows) // L - 1)
print(f"## {lab}: {len(rows)} records, {L} launches per step (candidates {dict(cand.most_common(3))}), last {nstep} steps")
per = collections.defaultdict(lambda: [0, 0.0])
walls, busys = [], []
for s in range(nstep):
    seg = rows[len(rows) - (s + 1) * L: len(rows) - s * L]
    walls.append((seg[-1][0] - seg[0][0]) / 1e6)  # start to start of the last: about one period
    # busy: union of intervals
    b, cur_s, cur_e = 0, None, None
    for st, en, k, n in seg:
        if cur_e is None or st > cur_e:
            if cur_e is not None: b += cur_e - cur_s
            cur_s, cur_e = st, en
        else: cur_e = max(cur_e, en)
    b += cur_e - cur_s
    busys.append(b / 1e6)
    for st, en, k, n in seg:
        per[n][0] += 1; per[n][1] += (en - st) / 1e3
tot = sum(v[1] for v in per.values()) / nstep / 1e3
print(f"period (first to last launch) ms: {[round(w, 3) for w in walls]}; busy (union) ms: {[round(b, 3) for b in busys]}; sum of kernel times {tot:.3f} ms")
def cat(n):
    s = n.lower()
    for k, v in [("sdpa", "cudnn-attn"), ("fmha", "cudnn-attn"), ("cudnn", "cudnn-attn"), ("flash", "cudnn-attn"),
                 ("gemm_fusion", "triton-gemm"), ("triton", "triton"), ("nvjet", "cublas"), ("gemm", "cublas"), ("cutlass", "cublas"), ("sm90_xmma", "cublas"), ("splitk", "cublas"),
                 ("memcpy", "memcpy"), ("memset", "memset"), ("transpose", "transpose"), ("reduce", "reduce"), ("reduction", "reduce"), ("convert", "convert")]:
        if k in s: return v
    return "loop/other"
cats = collections.defaultdict(lambda: [0, 0.0])
for n, v in per.items():
    c = cats[cat(n)]; c[0] += v[0]; c[1] += v[1]
print("| category | launches/step | us/step |\n|---|---|---|")
for c, v in sorted(cats.items(), key=lambda x: -x[1][1]):
    print(f"| {c} | {v[0] / nstep:.0f} | {v[1] / nstep:.1f} |")
print("| kernel | n/step | us/step |\n|---|---|---|")
for n, v in sorted(per.items(), key=lambda x: -x[1][1])[:70]:
    print(f"| {n[:110]} | {v[0] / nstep:.0f} | {v[1] / nstep:.1f} |")
