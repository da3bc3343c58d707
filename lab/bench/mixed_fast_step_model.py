#!/usr/bin/env python3
"""A host model of `carve bench device-alloc`'s mixed-size rows: how many class groups of a warp
win their run in carve_malloc's fast step, with and without the leader's retry in the run's word,
for runs that start at a hashed block (before fc05607) and for runs that start where the hint's
shard's count stands (fc05607 on).

Warps run one after another on a fresh heap (the GPU runs thousands at once, so real collisions
are at least this frequent). Sizes, classes and hints follow kernels/src (general::bench_request_size,
size_class::class_of, slab::group_hint); each class holds `slack` times its requests.

    python3 bench/mixed_fast_step_model.py LOG2_N MAX_BYTES [SLACK=1.25]
"""
import sys
M=(1<<64)-1
def mix(i,seed):
    x=((i ^ (seed<<32)) * 0x9E3779B97F4A7C15) & M
    x^=x>>29; x=(x*0xBF58476D1CE4E5B9)&M
    return x^(x>>32)
def class_of(b):
    n=b-1
    e=max(6,n.bit_length()-1)
    return 4*(e-6)+(n>>(e-2))
def rev(w): return int('{:032b}'.format(w)[::-1],2)
logn=int(sys.argv[1]); mx=int(sys.argv[2]); slack=float(sys.argv[3]) if len(sys.argv)>3 else 1.25
n=1<<logn; W=n//32
cls=[class_of(16+mix(i,1)%(mx-15)) for i in range(n)]
from collections import Counter
cnt=Counter(cls)
cap={c:int(v*slack)+1 for c,v in cnt.items()}
used={c:bytearray(cap[c]) for c in cnt}
groups=0; lost=0; lostlanes=0; gsizes=Counter()
for w in range(W):
    g=Counter(cls[w*32:(w+1)*32])
    gsizes[len(g)]+=1
    r=rev(w)
    for c,k in g.items():
        groups+=1
        h=(r*cap[c])>>32
        u=used[c]
        ok=True
        for j in range(k):
            p=h+j
            if p>=cap[c] or u[p]: ok=False; break
        if ok:
            for j in range(k): u[h+j]=1
        else:
            lost+=1
            # place elsewhere: first free from h
            p=h; got=0
            while got<k:
                p%=cap[c]
                if not u[p]: u[p]=1; got+=1
                p+=1
print(f"n=2^{logn} max={mx}: {groups/W:.1f} groups per warp; runs lost: {lost/groups*100:.1f} % of groups")
# With the leader's retry: the clear bits of the hint's word (carve_malloc does this), then of
# the next word (it does not: such groups take the per-group path).
used={c:bytearray(cap[c]) for c in cnt}
groups=0; fast=0; retry1=0; retry2=0; slow=0
for w in range(W):
    g=Counter(cls[w*32:(w+1)*32]); r=rev(w)
    for c,k in g.items():
        groups+=1; h=(r*cap[c])>>32; u=used[c]; C=cap[c]
        run=[h+j for j in range(k) if h+j<C]
        won=[p for p in run if not u[p]]
        for p in won: u[p]=1
        m=k-len(won)
        if m==0: fast+=1; continue
        rounds=0; wd=h//64
        while m>0 and rounds<2:
            rounds+=1
            free=[p for p in range(wd*64,min(C,wd*64+64)) if not u[p]][:m]
            for p in free: u[p]=1
            m-=len(free); wd=(wd+1)%((C+63)//64)
        if m==0:
            if rounds==1: retry1+=1
            else: retry2+=1
        else:
            slow+=1; p=h
            while m>0:
                p%=C
                if not u[p]: u[p]=1; m-=1
                p+=1
print(f"groups served by the run {fast/groups*100:.1f} %, by a retry in its word {retry1/groups*100:.1f} %, "
      f"needing the next word too {retry2/groups*100:.1f} %, by neither {slow/groups*100:.2f} %")

# Runs from the shard's count (fc05607): the hint picks the shard (heap_layout::slab_geometry's
# shards of up to 64 words); the reservation's fetch_add gives the run's start. On a fresh heap a
# run never meets another, so a group leaves the fast step only when its shard has too little
# room for it (short, or full).
def shard_log2(cap):
    nwords=(cap+63)//64; log2=0
    while log2<6 and (nwords>>(log2+1))>=16: log2+=1
    while -(-nwords//(1<<log2))>4096: log2+=1
    return log2
groups=0; whole=0; short=0; none=0
count={}
for w in range(W):
    g=Counter(cls[w*32:(w+1)*32]); r=rev(w)
    for c,k in g.items():
        groups+=1; C=cap[c]; lg=shard_log2(C); per=64<<lg
        s=((r*C)>>32)//per
        room=min(per,C-s*per)-count.get((c,s),0)
        take=min(k,max(room,0)); count[(c,s)]=count.get((c,s),0)+take
        if take==k: whole+=1
        elif take>0: short+=1
        else: none+=1
print(f"from the shard's count: whole run {whole/groups*100:.1f} %, a short reservation "
      f"{short/groups*100:.2f} %, a full shard {none/groups*100:.2f} % (both to the slow path)")
