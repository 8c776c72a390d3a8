import re,sys
lines=open(sys.argv[1],errors='replace').read().splitlines()
ts=[]
for i,l in enumerate(lines):
    m=re.match(r'^[IWE]\d{4} [\d:]+:(\d+\.\d+)\s',l)
    if m: ts.append((float(m.group(1)),i))
gaps=sorted(((ts[k+1][0]-ts[k][0],ts[k][1],ts[k+1][1]) for k in range(len(ts)-1)),reverse=True)[:int(sys.argv[2]) if len(sys.argv)>2 else 8]
for g,a,b in gaps:
    print("%.3f s gap"%g); print("  before:",lines[a][:230]); print("  after: ",lines[b][:230])
