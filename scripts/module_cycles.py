#!/usr/bin/env python3
"""Lists import cycles between the modules of each crate: `scripts/module_cycles.py crates/*/src`.
Exit status 1 when there is one (CI runs it)."""
import re,os,sys,itertools
def modname(crate_src, path):
    rel=os.path.relpath(path, crate_src)[:-3]
    parts=rel.split('/')
    if parts[-1] in ('mod','lib','main'): parts=parts[:-1]
    return '::'.join(parts) or 'crate'
found = False
for crate_src in sys.argv[1:]:
    mods={}
    for root,_,files in os.walk(crate_src):
        for f in files:
            if f.endswith('.rs'):
                p=os.path.join(root,f); mods[modname(crate_src,p)]=p
    edges={m:set() for m in mods}
    for m,p in mods.items():
        s=open(p).read(); s=re.sub(r'//[^\n]*', '', s)
        s=re.sub(r'#\[cfg\(test\)\]\s*mod tests \{.*', '', s, flags=re.S)
        for u in re.findall(r'\b(crate|super)::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)', s):
            kind,path=u
            if kind=='crate': parts=path.split('::')
            else:
                base=m.split('::')[:-1] if m!='crate' else []
                if os.path.basename(p)=='mod.rs': base=m.split('::')[:-1]
                parts=base+path.split('::')
            # longest prefix that is a module
            for k in range(len(parts),0,-1):
                cand='::'.join(parts[:k])
                if cand in mods and cand!=m and not m.startswith(cand+'::') :
                    edges[m].add(cand); break
    # find cycles (SCCs)
    index={};low={};st=[];on=set();res=[];i=[0]
    def sc(v):
        index[v]=low[v]=i[0];i[0]+=1;st.append(v);on.add(v)
        for w in edges[v]:
            if w not in index: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],index[w])
        if low[v]==index[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v:break
            if len(comp)>1: res.append(comp)
    for v in mods:
        if v not in index: sc(v)
    print(crate_src, 'cycles:', res if res else 'none')
    found = found or bool(res)
sys.exit(1 if found else 0)
