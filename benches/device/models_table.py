"""Issue 59's table from models.sh's results (one JSON object a line): per
model, kiln's step in both spellings, JAX and torch.compile on the same plain
code, and the ratios the issue sets (plain / builtin ≤ 1.05, plain / each
peer ≤ 1.0); with `hf` runs, Hugging Face's own models under torch.compile
(the model-zoo target: builtin / transformers ≤ 0.9)."""
import json
import sys

rows = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    r = json.loads(line)
    key = r["system"] if r["system"] != "kiln" else "kiln " + r["spelling"]
    rows.setdefault(r["model"], {})[key] = r

print("| model | kiln plain | kiln builtin | JAX (plain) | torch.compile (plain) | transformers + torch.compile "
      "| plain/builtin | plain/JAX | plain/torch | builtin/transformers |")
print("|---|---|---|---|---|---|---|---|---|---|")
for model in ["llama", "gpt2", "bert", "t5"]:
    r = rows.get(model, {})
    ms = {k: v["ms"] for k, v in r.items()}
    cell = lambda k: f"{ms[k]:.2f} ms" if k in ms else "—"  # noqa: E731
    ratio = lambda a, b: f"{ms[a] / ms[b]:.3f}" if a in ms and b in ms else "—"  # noqa: E731
    print(f"| {model} | {cell('kiln plain')} | {cell('kiln builtin')} | {cell('jax')} | {cell('torch')} | "
          f"{cell('hf')} | {ratio('kiln plain', 'kiln builtin')} | {ratio('kiln plain', 'jax')} | "
          f"{ratio('kiln plain', 'torch')} | {ratio('kiln builtin', 'hf')} |")
print()
for model, r in rows.items():
    for k, v in sorted(r.items()):
        extra = {x: v.get(x) for x in ("tokens_per_s", "first_step_s", "compile_s", "losses", "composites_found",
                                       "composites_missed", "host_record_ms", "host_grad_ms") if x in v}
        mem = v.get("xla", {}).get("temp_bytes") or v.get("temp_bytes") or v.get("peak_bytes")
        print(f"- {model} {k}: {v['ms']:.3f} ms, memory {mem}, {json.dumps(extra)}")
