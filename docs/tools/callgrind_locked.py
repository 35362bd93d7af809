#!/usr/bin/env python3
# Per-thread instructions and locked instructions (lock-prefixed, or xchg
# with memory) from callgrind files made with --separate-threads=yes
# --dump-instr=yes: python3 docs/tools/callgrind_locked.py <dir of callgrind.out.*>
# Run it before rebuilding: it disassembles the binaries named in the files.
import sys, re, subprocess, glob, collections
d=sys.argv[1]
files=sorted(glob.glob(d+'/callgrind.out.*'))
obnames={}
for f in files:
    for line in open(f):
        m=re.match(r'^(?:c?ob)=\((\d+)\) (.+)$',line.strip())
        if m: obnames[m.group(1)]=m.group(2)
per_thread={}
for f in files:
    counts=collections.Counter()
    ob=None; prev=[0,0]; skip=False
    for line in open(f):
        line=line.rstrip('\n')
        if not line: continue
        c=line[0]
        if line.startswith('ob='):
            ob=re.match(r'ob=\((\d+)\)',line).group(1); continue
        if line.startswith('calls='):
            skip=True; continue
        if c in '0123456789+-*' :
            parts=line.split()
            vals=[]
            for i,p in enumerate(parts[:2]):
                if p=='*': v=prev[i]
                elif p[0] in '+-': v=prev[i]+int(p,0) if not p[1:].startswith('0x') else prev[i]+int(p[0]+'1')*int(p[1:],16)
                else: v=int(p,0)
                vals.append(v)
            prev=vals
            ir=int(parts[2]) if len(parts)>2 else 0
            if skip: skip=False; continue
            counts[(ob,vals[0])]+=ir
    per_thread[f]=counts
locked_addrs={}
def lockset(path):
    if path in locked_addrs: return locked_addrs[path]
    s=set()
    try:
        out=subprocess.run(['objdump','-d','--no-show-raw-insn',path],capture_output=True,text=True).stdout
    except Exception: out=''
    for l in out.splitlines():
        m=re.match(r'^\s*([0-9a-f]+):\s+(.*)$',l)
        if not m: continue
        ins=m.group(2)
        if ins.startswith('lock ') or (ins.startswith('xchg') and '(' in ins):
            s.add(int(m.group(1),16))
    locked_addrs[path]=s
    return s
for f,counts in per_thread.items():
    total=sum(counts.values()); lk=0
    byob=collections.Counter()
    for (ob,a),n in counts.items():
        p=obnames.get(ob,'')
        if p.startswith('/') and a in lockset(p): lk+=n; byob[p.split('/')[-1]]+=n
    print(f.split('/')[-1], 'Ir', total, 'locked', lk, dict(byob))
