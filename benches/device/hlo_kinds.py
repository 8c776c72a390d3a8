"""Kernels of an XLA GPU program by kind, from its optimized HLO dump
(`--xla_dump_to DIR --xla_dump_hlo_as_text`, the `*after_optimizations.txt`
file): each top-level instruction of the entry computation that launches work
(fusions by kind, custom calls by target, copies, transposes, ...); bitcasts,
parameters, tuples and get-tuple-elements launch nothing and are left out.
Usage: hlo_kinds.py LABEL=FILE [LABEL=FILE ...]"""
import collections, re, sys

FREE = {"parameter", "bitcast", "tuple", "get-tuple-element", "constant"}


def kinds(path):
    txt = open(path).read()
    body = txt[txt.index("\nENTRY"):]
    body = body[body.index("{\n") + 2:]
    body = body[:body.index("\n}")]
    c = collections.Counter()
    for line in body.splitlines():
        m = re.search(r"[\]\)\}] ([a-z][\w-]*)\(", line)
        if not m or m.group(1) in FREE:
            continue
        op = m.group(1)
        if op == "fusion":
            k = re.search(r"kind=(\w+)", line).group(1)
            cfg = re.search(r'"kind":"(\w+)"', line)
            name = re.search(r"calls=%?([\w.-]+)", line)
            what = cfg.group(1) if cfg else re.sub(r"[._]?\d+$", "", name.group(1)) if name else ""
            c[f"fusion {k} {what}"] += 1
        elif op == "custom-call":
            c["custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)] += 1
        else:
            c[op] += 1
    return c


for arg in sys.argv[1:]:
    label, path = arg.split("=", 1)
    c = kinds(path)
    print(f"\n### {label}: {sum(c.values())} launching instructions")
    print("| kind | count |\n|---|---|")
    for k, v in c.most_common():
        print(f"| {k} | {v} |")
