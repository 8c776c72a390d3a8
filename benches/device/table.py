"""One ratio table from the device harness: kiln's figures (kiln.json) beside
its peers' (baseline.json, from peers.py). Usage: table.py KILN_JSON PEERS_JSON"""
import json, sys

def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"(no results in {path}: {e})", file=sys.stderr)
        return []

kiln, peers = load(sys.argv[1]), load(sys.argv[2])
works = []
for r in kiln + peers:
    if r["work"] not in works:
        works.append(r["work"])
print("| workload | kiln best | ms | best peer | ms | kiln / best peer | kiln / jax-jit | all (ms) |")
print("|---|---|---|---|---|---|---|---|")
for w in works:
    k = sorted((r for r in kiln if r["work"] == w), key=lambda r: r["ms"])
    p = sorted((r for r in peers if r["work"] == w), key=lambda r: r["ms"])
    jax = [r for r in p if r["system"] == "jax-jit"]
    allv = ", ".join(f'{r["system"]} {r["ms"]:.3f}' for r in k + p)
    kb = f'{k[0]["system"]} | {k[0]["ms"]:.3f}' if k else "— | —"
    pb = f'{p[0]["system"]} | {p[0]["ms"]:.3f}' if p else "— | —"
    ratio = f'{k[0]["ms"] / p[0]["ms"]:.2f}×' if k and p else "—"
    rj = f'{k[0]["ms"] / jax[0]["ms"]:.2f}×' if k and jax else "—"
    print(f"| {w} | {kb} | {pb} | {ratio} | {rj} | {allv} |")
for r in kiln:
    extra = {x: v for x, v in r.items() if x not in ("work", "system", "ms")}
    if extra:
        print(f'- {r["work"]} {r["system"]}: ' + ", ".join(f"{x} {v:.3f}" if isinstance(v, float) else f"{x} {v}" for x, v in extra.items()))
