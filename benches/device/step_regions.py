"""A traced step (ktrace.so TSV) split into the forward, the LM head and the
backward, with each region's kernel time by kind: how much of a step the
forward is, and where a plan's added time lands.

The step is the last NSTEP periods of L launches (L from ktrace.py's
header); the LM head spans the first to the last cuBLAS kernel of at least
MIN_US microseconds (gpt2-small's LM-head GEMMs take about 200 us on an H200,
the blocks' GEMMs under 80). With a second trace, prints the difference
region by region and kind by kind.

Usage: step_regions.py TRACE L [TRACE2 L2] [--steps N] [--min-us US]"""
import argparse
import collections
import re


def kind(name):
    n = name.lower()
    if "cudnn" in n or "sdpa" in n or "fmha" in n:
        return "cudnn"
    if n.startswith("nvjet") or ("gemm" in n and "fusion" not in n) or "cutlass" in n:
        return "cublas"
    if n.startswith("gemm_fusion"):
        return "triton-gemm"
    return re.sub(r"[._]\d+$", "", name)


def regions(path, launches, steps, min_us):
    rows = []
    for line in open(path, errors="replace"):
        p = line.rstrip("\n").split("\t")
        if len(p) >= 5:
            rows.append((int(p[1]), int(p[2]), p[4]))
    rows.sort()
    out = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for s in range(1, steps + 1):
        seg = rows[len(rows) - s * launches: len(rows) - (s - 1) * launches]
        big = [i for i, (a, b, n) in enumerate(seg) if kind(n) == "cublas" and (b - a) / 1e3 >= min_us]
        if not big:
            raise SystemExit(f"{path}: no cuBLAS kernel of {min_us} us or more in a step")
        for i, (a, b, n) in enumerate(seg):
            r = "forward" if i < big[0] else "lm head" if i <= big[-1] else "backward"
            cell = out[r][kind(n)]
            cell[0] += 1
            cell[1] += (b - a) / 1e3
    return {r: {k: (v[0] / steps, v[1] / steps) for k, v in ks.items()} for r, ks in out.items()}


def total(ks):
    return sum(v[1] for v in ks.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--min-us", type=float, default=150.0)
    a = ap.parse_args()
    runs = [regions(a.traces[i], int(a.traces[i + 1]), a.steps, a.min_us) for i in range(0, len(a.traces), 2)]
    order = ["forward", "lm head", "backward"]
    for path, run in zip(a.traces[::2], runs):
        step = sum(total(run[r]) for r in order)
        print(f"## {path}: {step:.0f} us of kernel time per step")
        for r in order:
            t = total(run[r])
            n = sum(v[0] for v in run[r].values())
            print(f"  {r:9s} {t:8.0f} us ({100 * t / step:4.1f}%), {n:.0f} launches")
    if len(runs) == 2:
        x, y = runs
        print("## difference (second - first)")
        for r in order:
            print(f"  {r}: {total(y[r]) - total(x[r]):+.0f} us")
            ks = sorted(set(x[r]) | set(y[r]), key=lambda k: -abs(y[r].get(k, (0, 0))[1] - x[r].get(k, (0, 0))[1]))
            for k in ks[:12]:
                (n0, t0), (n1, t1) = x[r].get(k, (0, 0.0)), y[r].get(k, (0, 0.0))
                if abs(t1 - t0) >= 10:
                    print(f"    {t1 - t0:+8.0f} us  {n0:4.0f} -> {n1:4.0f} launches  {k[:70]}")


if __name__ == "__main__":
    main()
