# The largest gaps between consecutive timestamped glog lines of an XLA log:
# where a process was silent (python3 gaps.py LOG [COUNT]). Reads both glog
# forms: `I1123 07:57:51.016037 ...` and `I0000 00:00:1795420621.679905 ...`.
import re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
ts = []
for i, l in enumerate(lines):
    m = re.match(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d+\.\d+)\s", l)
    if m:
        ts.append((int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)), i))
count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
gaps = sorted(((ts[k + 1][0] - ts[k][0], ts[k][1], ts[k + 1][1]) for k in range(len(ts) - 1)), reverse=True)[:count]
for g, a, b in gaps:
    print("%.3f s gap" % g)
    print("  before:", lines[a][:230])
    print("  after: ", lines[b][:230])
