"""One training step's kernels from Nsight Compute CSVs (`--metrics
gpu__time_duration.sum --csv --print-units base`), by kind, side by side.
The step is the launch sequence's last repeating period: the shortest P such
that the last P launch names equal the P before them (compile-time and
warm-up launches are left out whatever their names). Its time is the mean
over the last K periods (K = as many as repeat, at most 5).
Usage: step_kernels.py LABEL=CSV [LABEL=CSV ...]"""
import csv, re, sys
from collections import defaultdict

KINDS = [  # first match wins; names as XLA, cuBLAS, cuDNN and Triton spell kernels
    ("attention (cuDNN/flash)", r"fmha|flash|cudnn|sdpa|attention"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|matmul|triton_gemm|sm90_|wgmma"),
    ("transpose/copy", r"transpose|copy|concatenate|memcpy|memset|dynamic_update_slice|slice"),
    ("reduction (incl. layer norm, softmax, CE)", r"reduce|reduction|softmax|norm|welford|persistent"),
    ("elementwise / other fusion", r"."),
]


def launches(path):
    lines = [l for l in open(path, errors="replace") if l.startswith('"')]
    out = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        out.append((int(r["ID"]), r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    out.sort()
    return [(n, t) for _, n, t in out]


def step_of(seq):
    names = [n for n, _ in seq]
    for p in range(1, len(names) // 2 + 1):
        if names[-p:] == names[-2 * p:-p]:
            k = 2
            while k < 5 and (k + 1) * p <= len(names) and names[-(k + 1) * p:-k * p] == names[-p:]:
                k += 1
            per = defaultdict(float)
            for i in range(k):
                for n, t in seq[len(seq) - (i + 1) * p:len(seq) - i * p]:
                    per[n] += t / k
            return p, k, per
    return None


def kind(name):
    for k, rx in KINDS:
        if re.search(rx, name, re.I):
            return k
    return KINDS[-1][0]


for arg in sys.argv[1:]:
    label, path = arg.split("=", 1)
    try:
        seq = launches(path)
    except OSError as e:
        print(f"\n### {label}: no profile ({e})")
        continue
    found = step_of(seq)
    if not found:
        print(f"\n### {label}: no repeating step in {len(seq)} launches")
        continue
    p, k, per = found
    total = sum(per.values()) / 1e3
    print(f"\n### {label}: {p} launches per step (period seen {k}x), {total:.2f} ms of kernel time per step")
    by = defaultdict(lambda: [0, 0.0])
    counts = defaultdict(int)
    for n, _ in seq[-p:]:
        counts[n] += 1
    for n, t in per.items():
        by[kind(n)][0] += counts[n]
        by[kind(n)][1] += t
    print("| kind | launches | ms/step |\n|---|---|---|")
    for kd, _ in KINDS:
        if kd in by:
            print(f"| {kd} | {by[kd][0]} | {by[kd][1] / 1e3:.3f} |")
    print("\n| kernel (top 30) | launches | ms/step |\n|---|---|---|")
    for n, t in sorted(per.items(), key=lambda kv: -kv[1])[:30]:
        print(f"| `{n[:100]}` | {counts[n]} | {t / 1e3:.3f} |")
