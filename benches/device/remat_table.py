"""The remat-curve table: kiln's RESULT lines (remat_curve, one per budget)
beside JAX's plain and full-block-checkpoint figures (jax_gpt.py --json).
Usage: remat_table.py KILN_LOG [JAX_PLAIN.json] [JAX_CHECKPOINT.json] [--json OUT]
Temp cuts and overheads are against the same system's unplanned step (kiln's:
the mean step time of its `none` rows, when the budgets list it more than once)."""
import json, sys

args = sys.argv[1:]
out_path = None
if "--json" in args:
    i = args.index("--json")
    out_path = args[i + 1]
    args = args[:i] + args[i + 2:]
kiln_log, jax_paths = args[0], args[1:]
rows = []
for line in open(kiln_log):
    if line.startswith("RESULT "):
        rows.append(json.loads(line[len("RESULT "):]))
jax = []
for p in jax_paths:
    try:
        jax.append(json.load(open(p)))
    except (OSError, ValueError) as e:
        print(f"(no JAX figures from {p}: {e})")

mib = lambda b: f"{b / 2**20:,.0f}"
gib = lambda b: f"{b / 2**30:.2f}"
unplanned = [r for r in rows if r["budget_pct"] is None]
base = unplanned[0] if unplanned else None
base_ms = sum(r["ms"] for r in unplanned) / len(unplanned) if unplanned else None
print(f"| system | budget (% of activation memory) | recomputed values (cloned nodes) | extra FLOPs (% of step) "
      f"| model temp before -> after (MiB) | XLA args / outputs / aliased (GiB) | XLA temp (GiB) | temp cut "
      f"| XLA peak (GiB) | peak cut | ms/step | overhead |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
summary = []
for r in rows:
    x = r["xla"]
    plan = r.get("plan") or {}
    cut = base["xla"]["temp_bytes"] / x["temp_bytes"] if base and x["temp_bytes"] else None
    pcut = base["xla"]["peak_bytes"] / x["peak_bytes"] if base and x["peak_bytes"] else None
    over = r["ms"] / base_ms - 1 if base else None
    base_flops = base["step_flops"] if base else None
    fl = r["extra_flops"]
    flp = f"{fl:.3g} ({100 * fl / base_flops:.1f}%)" if base_flops else f"{fl:.3g}"
    rec = f"{plan['recomputed']} ({plan['cloned_nodes']})" if plan else "—"
    model = (f"{mib(plan['model_before']['temp_bytes'])} -> {mib(plan['model_after']['temp_bytes'])}"
             + ("" if plan["met"] else " (budget not met)")) if plan else "—"
    budget = "none" if r["budget_pct"] is None else f"{r['budget_pct']:.0f}%"
    if r.get("host_copies"):
        moved = f"{plan['offloaded']} values, {mib(plan['offloaded_bytes'])} MiB" if plan else "none"
        budget += f" + host copies ({moved} moved)"
    # Without a `none` row (REMAT_BUDGETS without it) there is nothing to cut from.
    k = lambda v, fmt: "—" if v is None else fmt.format(v)
    print(f"| kiln | {budget} | {rec} | {flp if plan else '—'} | {model} "
          f"| {gib(x['argument_bytes'])} / {gib(x['output_bytes'])} / {gib(x['alias_bytes'])} | {gib(x['temp_bytes'])} "
          f"| {k(cut, '{:.2f}×')} | {gib(x['peak_bytes'])} | {k(pcut, '{:.2f}×')} | {r['ms']:.2f} "
          f"| {k(over if over is None else 100 * over, '{:+.1f}%')} |")
    summary.append({"system": "kiln", "budget_pct": r["budget_pct"], "budget": budget, "temp_cut": cut,
                    "peak_cut": pcut, "overhead": over})
jbase = next((j for j in jax if not j["system"].endswith("checkpoint")), None)
for j in jax:
    x = j["xla"]
    cut = jbase["xla"]["temp_bytes"] / x["temp_bytes"] if jbase else None
    pcut = jbase["xla"]["peak_bytes"] / x["peak_bytes"] if jbase else None
    over = j["ms"] / jbase["ms"] - 1 if jbase else None
    name = "full-block checkpoint" if j["system"].endswith("checkpoint") else "none"
    f = lambda v, fmt: "—" if v is None else fmt.format(v)
    print(f"| JAX ({j['system']}) | {name} | {'every block' if name != 'none' else '—'} | — | — "
          f"| {gib(x['argument_bytes'])} / {gib(x['output_bytes'])} / {gib(x['alias_bytes'])} | {gib(x['temp_bytes'])} "
          f"| {f(cut, '{:.2f}×')} | {gib(x['peak_bytes'])} | {f(pcut, '{:.2f}×')} | {j['ms']:.2f} "
          f"| {f(over and 100 * over, '{:+.1f}%')} |")
    summary.append({"system": j["system"], "temp_cut": cut, "peak_cut": pcut, "overhead": over})

print()
for need_cut, max_over in ((2.0, 0.05), (4.6, 0.15)):
    hits = [s for s in summary if s["system"] == "kiln" and s["temp_cut"] and s["temp_cut"] >= need_cut
            and s["overhead"] is not None and s["overhead"] <= max_over]
    kiln = [s for s in summary if s["system"] == "kiln" and s["budget_pct"] is not None and s["temp_cut"]
            and s["overhead"] is not None]
    # A miss names both sides of the line: the largest cut within the time, and the cheapest that cuts enough.
    within = max((s for s in kiln if s["overhead"] <= max_over), key=lambda s: s["temp_cut"], default=None)
    enough = min((s for s in kiln if s["temp_cut"] >= need_cut), key=lambda s: s["overhead"], default=None)
    near = [f"at ≤ {max_over * 100:.0f}%: {s['temp_cut']:.2f}× at {s['overhead'] * 100:+.1f}% ({s['budget']})"
            for s in [within] if s] + [f"{s['temp_cut']:.2f}× costs {s['overhead'] * 100:+.1f}% ({s['budget']})"
                                       for s in [enough] if s]
    verdict = ("met at " + ", ".join(h["budget"] for h in hits) if hits else
               f"not met ({'; '.join(near)})" if near else "no data")
    print(f"- target ≥ {need_cut}× XLA temp cut at ≤ {max_over * 100:.0f}% step time: {verdict}")
if base and jbase:
    each = ", ".join(f"{r['ms']:.2f}" for r in unplanned)
    runs = f" (mean of {len(unplanned)} runs: {each})" if len(unplanned) > 1 else ""
    print(f"- unplanned step: kiln {base_ms:.2f} ms{runs}, XLA temp {gib(base['xla']['temp_bytes'])} GiB; "
          f"JAX {jbase['ms']:.2f} ms, XLA temp {gib(jbase['xla']['temp_bytes'])} GiB")
if out_path:
    json.dump({"kiln": rows, "jax": jax, "summary": summary}, open(out_path, "w"), indent=1)
