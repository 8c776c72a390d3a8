"""Per-kernel GPU time of one training step from two Nsight Compute CSVs
(`--metrics gpu__time_duration.sum --csv`), side by side. Kernels launched at
least STEPS times are the step's (autotuning candidates run a few times only);
their time per step is their total over STEPS.
Usage: kernels.py KILN_CSV JAX_CSV [STEPS]"""
import csv, sys
from collections import defaultdict

steps = int(sys.argv[3]) if len(sys.argv) > 3 else 30

def load(path):
    rows = []
    try:
        lines = [l for l in open(path) if l.startswith('"')]
    except OSError as e:
        print(f"(no {path}: {e})")
        return {}
    count, total = defaultdict(int), defaultdict(float)
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"][:90]
        count[name] += 1
        total[name] += float(r["Metric Value"].replace(",", ""))
    return {k: (count[k], total[k]) for k in count if count[k] >= steps}

for label, path in (("kiln", sys.argv[1]), ("jax", sys.argv[2])):
    ks = load(path)
    per_step = sum(t for _, t in ks.values()) / steps / 1e3
    print(f"\n### {label}: {per_step:.1f} µs of kernels per step, {sum(c for c, _ in ks.values()) / steps:.0f} launches per step")
    print("| kernel | launches/step | µs/step |")
    print("|---|---|---|")
    for name, (c, t) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| `{name}` | {c / steps:.1f} | {t / steps / 1e3:.1f} |")
