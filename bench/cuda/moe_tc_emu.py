#!/usr/bin/env python3
# moe_tc_emu — a host emulation of src/backend/cuda/moe_tc.cu's moe_tc_kernel, for checking its
# index math without a GPU: the tile list (tiles_kernel), the per-thread weight and activation
# loaders (rows past an expert's zero-filled, features past n_out zero), the two shared-memory
# stages and their order, the fragment loads, mma.sync m16n8k16 by the PTX ISA's fragment layout
# ("Matrix Fragments for mma.m16n8k16 with floating point type": A/B reassembled from the 32
# lanes, C handed back the same way), and the epilogue (each output written once), against a plain
# product. Values are exact dyadics (e2m1 x 2^s, x in eighths), so any mismatch is an indexing
# bug. Transcribed line by line from the kernel: re-run after changing its index math (pure
# Python, ~10 s): python3 bench/cuda/moe_tc_emu.py  (exit 1 on a mismatch). The weight decode is
# emulated at the byte level (16-byte loads as little-endian words, FP4 nibble / FP8 byte order,
# BF16 pairs low half first, the uint4 stores) against di_w_at's element order; the arithmetic
# (e2m1 bit placement, BF16 rounding) is exact and checked bit for bit on the host separately.
import random
random.seed(1)
TC_BM, TC_BK, TC_LD, THREADS = 128, 64, 72, 256

def e2m1(c):
    e=(c>>1)&3; m=c&1
    v = 0.5*m if e==0 else (1+0.5*m)*(1<<(e-1))
    return -v if c&8 else v

def e4m3(b):
    sign = -1.0 if b & 0x80 else 1.0
    e = (b >> 3) & 15; m = b & 7
    if e == 0: return sign * m / 8 * 2.0 ** -6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)

def words(bs):  # little-endian 32-bit words of a byte list
    return [bs[4*i] | bs[4*i+1] << 8 | bs[4*i+2] << 16 | bs[4*i+3] << 24 for i in range(len(bs)//4)]

def tiles_list(offsets, E, bn, max_tiles):
    base=[0]*(E+1)
    for e in range(E):
        c=offsets[e+1]-offsets[e]; base[e]=(c+bn-1)//bn if c>0 else 0
    acc=0
    for e in range(E):
        c=base[e]; base[e]=acc; acc+=c
    base[E]=acc
    n=min(acc,max_tiles)
    tiles=[None]*max_tiles
    for e in range(E):
        r0=offsets[e]
        j=base[e]
        while j<base[e+1] and j<max_tiles:
            tiles[j]=(e, r0+(j-base[e])*bn); j+=1
    return tiles, n

def run(E, counts, n_out, K, BN, WM_W, WN_W, x_rows_on, ys, fp8=False):
    WM=TC_BM//WM_W; WN=BN//WN_W; MT=WM//16; NT=WN//8
    XCH=BN*(TC_BK//8); XPT=(XCH+THREADS-1)//THREADS
    offsets=[0]
    for c in counts: offsets.append(offsets[-1]+c)
    n_rows=offsets[-1]
    n_src = 7 if x_rows_on else n_rows
    x_rows=[random.randrange(n_src) for _ in range(n_rows)] if x_rows_on else None
    # weights: FP4 codes and per-32 scale exponents; we emulate values directly
    # Raw rows as the device holds them: FP4 two codes per byte (low nibble first), per-32 scales
    # per row; FP8 one code per byte (no NaN codes), 128x128 scales. Scales as exponents.
    bi = 128 if fp8 else 32
    nb = K if fp8 else K // 2
    R=[[[random.randrange(256) for _ in range(nb)] for _ in range(n_out)] for _ in range(E)]
    if fp8:
        for e in range(E):
            for o in range(n_out):
                R[e][o]=[c ^ 1 if (c & 0x7F) == 0x7F else c for c in R[e][o]]
    srows = (n_out + 127)//128 if fp8 else n_out
    S=[[[random.randrange(-3,4) for _ in range(K//bi)] for _ in range(srows)] for _ in range(E)]
    X=[[random.randrange(-8,9)/8 for _ in range(K)] for _ in range(n_src)]
    def srow(e, o): return S[e][o // 128 if fp8 else o]
    def wval(e,o,k):  # di_w_at
        if fp8: return e4m3(R[e][o][k]) * 2.0 ** srow(e,o)[k // bi]
        byte = R[e][o][k >> 1]
        return e2m1(byte >> 4 if k & 1 else byte & 15) * 2.0 ** srow(e,o)[k // bi]
    y=[[None]*ys for _ in range(n_rows)]
    max_tiles = n_rows//BN + min(E, n_rows)
    tiles, ntiles = tiles_list(offsets, E, BN, max_tiles)
    gx=(n_out+TC_BM-1)//TC_BM
    for by in range(max_tiles):
      for bx in range(gx):
        if by >= ntiles: continue
        e,i0 = tiles[by]; iend=offsets[e+1]; nrow=min(iend-i0,BN); o0=bx*TC_BM
        ws=[[[0.0]*TC_LD for _ in range(TC_BM)] for _ in range(2)]
        xs=[[[0.0]*TC_LD for _ in range(BN)] for _ in range(2)]
        acc={}  # (tid,a,b,c)
        for tid in range(THREADS):
            for a in range(MT):
                for b in range(NT):
                    for c in range(4): acc[(tid,a,b,c)]=0.0
        # per-thread loader state
        st={}
        for tid in range(THREADS):
            lr=tid>>1; kh=(tid&1)*32; ow=o0+lr; wvalid=ow<n_out
            xsrc=[]; xbytes=[]
            for q in range(XPT):
                p=tid+q*THREADS; j=p>>3
                live = p<XCH and j<nrow
                i=i0+(j if live else 0)
                src = x_rows[i] if x_rows else i
                xsrc.append((src,(p&7)*8)); xbytes.append(16 if live else 0)
            st[tid]=dict(lr=lr,kh=kh,ow=ow,wvalid=wvalid,xsrc=xsrc,xbytes=xbytes,wq=None)
        def issue_x(tid,k0,buf):
            s=st[tid]
            for q in range(XPT):
                p=tid+q*THREADS
                if p<XCH:
                    src,col=s['xsrc'][q]
                    for u in range(8):
                        xs[buf][p>>3][(p&7)*8+u] = X[src][k0+col+u] if s['xbytes'][q]==16 else 0.0
        def load_w(tid,k0):  # the kernel's 16-byte loads (WQ of them) and the scale byte
            s=st[tid]; k=k0+s['kh']
            if s['wvalid']:
                row=R[e][s['ow']]; off = k if fp8 else k // 2
                s['wq'] = [words(row[off + 16*q: off + 16*q + 16]) for q in range(2 if fp8 else 1)]
                s['wsc'] = srow(e, s['ow'])[k // bi]
            else:
                s['wq'] = [[0]*4 for q in range(2 if fp8 else 1)]; s['wsc'] = 0
        def store_w(tid,buf):  # the kernel's out[16] pairs (lo, hi) and uint4 stores
            s=st[tid]; sc = 2.0 ** s['wsc']; out=[None]*16
            if fp8:
                for q in range(2):
                    u = s['wq'][q]
                    for k4 in range(4):
                        for h in range(2):
                            out[q*8 + k4*2 + h] = (e4m3((u[k4] >> (16*h)) & 0xFF) * sc,
                                                   e4m3((u[k4] >> (16*h + 8)) & 0xFF) * sc)
            else:
                u = s['wq'][0]
                for k4 in range(4):
                    for b in range(4):
                        byte = u[k4] >> (8*b)
                        out[k4*4 + b] = (e2m1(byte & 15) * sc, e2m1((byte >> 4) & 15) * sc)
            for q in range(4):  # dst[q] = uint4(out[4q .. 4q+3]): 8 BF16 at kh + 8q
                for i in range(4):
                    lo, hi = out[4*q + i]
                    ws[buf][s['lr']][s['kh'] + 8*q + 2*i] = lo
                    ws[buf][s['lr']][s['kh'] + 8*q + 2*i + 1] = hi
        nk=K//TC_BK
        for tid in range(THREADS): issue_x(tid,0,0); load_w(tid,0); store_w(tid,0)
        for kt in range(nk):
            buf=kt&1; nxt=kt+1<nk
            if nxt:
                for tid in range(THREADS): issue_x(tid,(kt+1)*TC_BK,buf^1); load_w(tid,(kt+1)*TC_BK)
            Wb=ws[buf]; Xb=xs[buf]
            for warp in range(8):
                wm=warp//WN_W; wn=warp%WN_W
                for kk in range(0,TC_BK,16):
                    af={}; bfr={}
                    for lane in range(32):
                        g=lane>>2; t4=lane&3; tid=warp*32+lane
                        for a in range(MT):
                            r=wm*WM+a*16+g; c0=kk+2*t4
                            af[(lane,a)]=[(Wb[r][c0],Wb[r][c0+1]),(Wb[r+8][c0],Wb[r+8][c0+1]),(Wb[r][c0+8],Wb[r][c0+9]),(Wb[r+8][c0+8],Wb[r+8][c0+9])]
                        for b in range(NT):
                            n=wn*WN+b*8+g; c0=kk+2*t4
                            bfr[(lane,b)]=[(Xb[n][c0],Xb[n][c0+1]),(Xb[n][c0+8],Xb[n][c0+9])]
                    for a in range(MT):
                        for b in range(NT):
                            # PTX layout: reassemble A[16][16], B[16][8]
                            A=[[0]*16 for _ in range(16)]; B=[[0]*8 for _ in range(16)]
                            for lane in range(32):
                                g=lane>>2; t=lane&3
                                ar=af[(lane,a)]
                                for i in range(8):
                                    row = g if (i<2 or 4<=i<6) else g+8
                                    col = t*2+(i&1) + (8 if i>=4 else 0)
                                    A[row][col]=ar[i//2][i&1]
                                br=bfr[(lane,b)]
                                for i in range(4):
                                    row = t*2+(i&1) + (8 if i>=2 else 0)
                                    B[row][g]=br[i//2][i&1]
                            for lane in range(32):
                                g=lane>>2; t=lane&3; tid=warp*32+lane
                                for c in range(4):
                                    row = g + (8 if c>=2 else 0); col=t*2+(c&1)
                                    acc[(tid,a,b,c)] += sum(A[row][k]*B[k][col] for k in range(16))
            if nxt:
                for tid in range(THREADS): store_w(tid,buf^1)
        for tid in range(THREADS):
            warp=tid>>5; lane=tid&31; g=lane>>2; t4=lane&3; wm=warp//WN_W; wn=warp%WN_W
            for a in range(MT):
                for b in range(NT):
                    for c in range(4):
                        o=o0+wm*WM+a*16+g+(c>>1)*8; j=wn*WN+b*8+2*t4+(c&1)
                        if o<n_out and j<nrow:
                            assert y[i0+j][o] is None, "written twice"
                            y[i0+j][o]=acc[(tid,a,b,c)]
    bad=0
    for e in range(E):
        for i in range(offsets[e],offsets[e+1]):
            src=x_rows[i] if x_rows else i
            for o in range(n_out):
                ref=sum(wval(e,o,k)*X[src][k] for k in range(K))
                if y[i][o] is None or abs(y[i][o]-ref)>1e-9*max(1,abs(ref)): bad+=1
    print(f"{'FP8' if fp8 else 'FP4'} BN={BN} E={E} counts={counts} n_out={n_out} K={K} x_rows={x_rows_on}: bad {bad} of {n_rows*n_out}")
    return bad

tot=0
tot+=run(3,[0,5,70],136,128,64,4,2,True,140)
tot+=run(4,[1,0,17,3],8,64,16,8,1,False,8)
tot+=run(2,[16,33],130,192,16,8,1,True,130)
tot+=run(3,[0,5,70],136,256,64,4,2,True,136,fp8=True)
tot+=run(2,[16,33],130,128,16,8,1,False,130,fp8=True)
print("TOTAL BAD", tot)
raise SystemExit(1 if tot else 0)
