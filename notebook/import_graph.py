"""Module-level import graph of a crate's src/ and its cycles (strongly
connected components of more than one module). Test code (`#[cfg(test)]`
onwards, `tests.rs`) is left out. One-off check for the house issue:

    python3 notebook/import_graph.py compiler/src
"""
import os
import re
import sys

root = sys.argv[1]
mods = {}
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs') or f == 'tests.rs':
            continue
        p = os.path.join(dp, f)
        rel = os.path.relpath(p, root)[:-3].split(os.sep)
        if rel[-1] in ('mod', 'lib', 'main'):
            rel = rel[:-1]
        mods[tuple(rel)] = p


def resolve(path):
    """Longest module prefix of `path` that is a file."""
    for i in range(len(path), -1, -1):
        if tuple(path[:i]) in mods:
            return tuple(path[:i])
    return None


edges = {m: set() for m in mods}
for m, p in mods.items():
    s = open(p).read()
    cut = s.find('#[cfg(test)]')
    if cut >= 0:
        s = s[:cut]
    s = re.sub(r'//.*', '', s)
    refs = []
    for mt in re.finditer(r'\bcrate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)', s):
        refs.append(mt.group(1).split('::'))
    for mt in re.finditer(r'use crate::\{([^}]*)\}', s):
        for item in mt.group(1).split(','):
            item = item.strip()
            if item:
                refs.append(item.split('::')[0:1])
    for mt in re.finditer(r'use ((?:super::)+)\{([^}]*)\}', s):
        ups = mt.group(1).count('super::')
        for item in mt.group(2).split(','):
            item = item.strip()
            if item:
                refs.append(list(m)[: len(m) - ups] + item.split('::')[0:1])
    for mt in re.finditer(r'\b((?:super::)+)((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)', s):
        ups = mt.group(1).count('super::')
        base = list(m)
        is_mod = os.path.basename(p) in ('mod.rs', 'lib.rs')
        base = base[: len(base) - ups] if is_mod else base[: len(base) - ups]
        refs.append(base + mt.group(2).split('::'))
    for r in refs:
        t = resolve(r)
        if t is not None and t != m and t != ():
            edges[m].add(t)

# Tarjan
index, low, stack, on, sccs = {}, {}, [], set(), []
counter = [0]


def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            strong(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            sccs.append(comp)


sys.setrecursionlimit(10000)
for v in edges:
    if v not in index:
        strong(v)
for c in sccs:
    print('cycle:', ', '.join('::'.join(x) or 'crate' for x in sorted(c)))
    for a in sorted(c):
        for b in sorted(edges[a] & set(c)):
            print('   ', '::'.join(a), '->', '::'.join(b))
print(len(sccs), 'cycles')
