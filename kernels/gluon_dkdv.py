"""Hopper-native first-backward dK/dV pass in Gluon (TMA + async wgmma).

``attn_bwd`` calls :func:`gluon_dkdv` instead of the Triton ``_attn_bwd_dkdv_kernel``
(attn_bwd.py) where ``configs.use_gluon("bwd_dkdv", ...)`` selects it: sm_90, inputs in the
scope below, tiles from ``configs.GLUON``; everywhere else (interpreter, other GPUs, other
inputs) the Triton pass runs. Measured on an H200 (triton 3.6): matches float64 autograd as
closely as the Triton pass (bf16, full and causal, every tile variant); at N = 16K, H = 12,
d = 64 its best tile (64 keys x 64 queries, 4 warps) takes 3.29 ms against the Triton pass's
3.60 ms (causal 1.76 vs 1.85 ms) (``scripts/gluon_dkdv_check.py``; docs/benchmarks.md,
"Gluon (item 2), first step"). At d = 128 (H = 8, N = 16K) 64 x 64 / 4 takes 3.3 ms in the
chain against 4.0 ms; with GQA the query heads of a kv head are swept in turn ("Gluon at
d = 128 and GQA").

One program owns one key tile (BLOCK_N keys of one (batch, kv head)): K and V come to shared
memory once by TMA; the query tiles that can see the keys, of every query head that reads
this kv head (GQA: H_q / H_kv of them, one sweep after the other), stream through a two-slot
ring of Q / dO tiles (TMA, one mbarrier per slot, the next tile's copy issued before the current
tile's MMAs). Per query tile, in (keys x queries) orientation, with τ = ``scale``:

    Sᵀ = K Qᵀ,  Pᵀ = exp2(τ·log2e·Sᵀ − L·log2e),  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ∘(dPᵀ − D)
    dV += Pᵀ dO,   dK += dSᵀ Q        (dK scaled by τ at the end)

The four products are ``warpgroup_mma`` (Sᵀ and dPᵀ issued together asynchronously; Pᵀ and
dSᵀ as register A operands). No warp specialisation yet (single partition).

Scope (checked, with a ValueError naming the argument): dense (B, H, N, D) inputs with
H_q a multiple of H_kv (MHA, GQA, MQA), N_q == N_k, N a multiple of the key tile, d in
{64, 128}, bf16 or fp16, full or causal (no window, no varlen, no ρ row-sum correction, which
16-bit inputs do not use).
"""

from __future__ import annotations

import torch

from . import gluon_common as _gc

if _gc.HAVE_GLUON:
    from .gluon_common import (  # noqa: F401 - names the kernels below resolve
        gluon,
        gl,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
        TensorDescriptor,
    )
    from .gluon_common import tma_load as _tma_load
    from .gluon_common import tma_store as _tma_store

#: Gluon's Hopper ops import (gluon_common.py)
HAVE_GLUON = _gc.HAVE_GLUON

LOG2E = _gc.LOG2E
BLOCK_N = 128
BLOCK_M = 64
NUM_WARPS = 8


def available(device=None) -> bool:
    """True where Gluon's Hopper ops import and the CUDA device is sm_90 (Hopper)."""
    return HAVE_GLUON and _gc.hopper_device(device)


if HAVE_GLUON:

    @gluon.jit
    def _query_tile(qrow0, i, lo, n_tiles, N, BLOCK_M: gl.constexpr, GROUPS: gl.constexpr):
        """(flat row of the first query, its position in the sequence) of step ``i`` of the
        sweep over the query tiles of every head of the group (head i // n_tiles); with one
        head per group no division."""
        if GROUPS == 1:
            m0 = lo + i * BLOCK_M
            row = qrow0 + m0
        else:
            m0 = lo + (i % n_tiles) * BLOCK_M
            row = qrow0 + (i // n_tiles) * N + m0
        return row, m0

    @gluon.jit
    def _gluon_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA,
                           N, scale, qk_scale2, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                           GROUPS: gl.constexpr, num_warps: gl.constexpr):
        """dK, dV of key tile ``program_id(0)`` of (batch·kv head) ``program_id(1)``, summed
        over its GROUPS query heads (b·H_kv + j serves query heads (b·H_kv + j)·GROUPS + g);
        the descriptors view (B·H·N, d) tensors (H = H_q for Q / dO, H_kv for K / V / dK /
        dV), LSE / DELTA are contiguous (B·H_q·N,) float32."""
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
        n0 = pid_n * BLOCK_N
        row0 = bh * N  # TMA coordinates are int32 (checked by the wrapper)
        qrow0 = bh * GROUPS * N  # first query row of the group
        dtype: gl.constexpr = q_desc.dtype

        # keys along M (BLOCK_N rows, 16 per warp), queries / d along N of the instruction
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ld_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ld_bar.index(0), count=1)
        mbarrier.init(ld_bar.index(1), count=1)

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [row0 + n0, 0], kv_bar, k_smem)
        _tma_load(v_desc, [row0 + n0, 0], kv_bar, v_smem)

        if CAUSAL:
            lo = n0  # query tiles before the key tile see none of its keys
        else:
            lo = 0
        n_tiles = (N - lo) // BLOCK_M
        # one sweep over the query tiles of every head of the group (tile i: head
        # i // n_tiles), so that the ring streams across heads
        total = GROUPS * n_tiles
        tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        mbarrier.expect(ld_bar.index(0), tile_bytes)
        _tma_load(q_desc, [qrow0 + lo, 0], ld_bar.index(0), q_smem.index(0))
        _tma_load(do_desc, [qrow0 + lo, 0], ld_bar.index(0), do_smem.index(0))

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(kv_bar, 0)

        for i in range(total):
            slot = i % 2
            qrow, m0 = _query_tile(qrow0, i, lo, n_tiles, N, BLOCK_M, GROUPS)
            qrow = qrow - m0  # the head's first row
            if i + 1 < total:  # prefetch the next tile into the other slot
                nxt = 1 - slot
                nrow, _ = _query_tile(qrow0, i + 1, lo, n_tiles, N, BLOCK_M, GROUPS)
                mbarrier.expect(ld_bar.index(nxt), tile_bytes)
                _tma_load(q_desc, [nrow, 0], ld_bar.index(nxt), q_smem.index(nxt))
                _tma_load(do_desc, [nrow, 0], ld_bar.index(nxt), do_smem.index(nxt))
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            lse2 = gl.load(LSE + qrow + offs_m) * 1.4426950408889634
            lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
            di = gl.load(DELTA + qrow + offs_m)
            mbarrier.wait(ld_bar.index(slot), (i // 2) & 1)
            q_s = q_smem.index(slot)
            do_s = do_smem.index(slot)

            st = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
            pt = gl.exp2(st * qk_scale2 - gl.expand_dims(lse2, 0))
            if CAUSAL:
                vis = gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1)
                pt = gl.where(vis, pt, 0.0)
            dst = pt * (dpt - gl.expand_dims(di, 0))

            p_op = gl.convert_layout(pt.to(dtype), op_layout)
            ds_op = gl.convert_layout(dst.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))

        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ld_bar.index(0))
        mbarrier.invalidate(ld_bar.index(1))

        dk_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], dk_desc.layout)
        dv_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], dv_desc.layout)
        dk_smem.store((dk * scale).to(dtype))
        dv_smem.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [row0 + n0, 0], dk_smem)
        _tma_store(dv_desc, [row0 + n0, 0], dv_smem)
        tma.store_wait(pendings=0)


def _check(name, x, like, heads=None):
    """``x`` like ``like`` in dtype, device, batch, length and head dim, with ``heads`` heads
    (default: like's)."""
    want = tuple(like.shape) if heads is None else (like.shape[0], heads, *like.shape[2:])
    if tuple(x.shape) != want or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(f"gluon_dkdv: {name} must have shape {want}, q's dtype and device "
                         f"(got {tuple(x.shape)}, {x.dtype}, {x.device}); varlen is not "
                         "supported here")


def gluon_dkdv(q, k, v, do, lse, delta, *, scale=None, causal=False, block_n=BLOCK_N,
               block_m=BLOCK_M, num_warps=NUM_WARPS, maxnreg=None, out=None):
    """dK, dV of softmax attention from the forward's ``lse`` and ``delta`` = rowsum(dO∘O).

    q, do: (B, H_q, N, d) and k, v: (B, H_kv, N, d), bf16/fp16 on one sm_90 device, H_q a
    multiple of H_kv (GQA: query head h reads kv head h // (H_q / H_kv)); lse, delta:
    (B, H_q, N) float32 (natural-log LSE, as ``attn_fwd`` returns it). Returns (dk, dv),
    each (B, H_kv, N, d) in q's dtype, summed over the query heads of each kv head. Inputs
    that are not contiguous are copied. ``block_n`` keys per program (16 per warp:
    block_n == 16·num_warps, num_warps 4 or 8), ``block_m`` queries per step (dividing
    block_n); ``maxnreg`` caps ptxas's registers per thread (None: no cap).
    ``out``: optional (dk, dv) pair of contiguous tensors like k to write into.
    """
    if not available(q.device):
        raise RuntimeError("gluon_dkdv: needs triton.experimental.gluon and an sm_90 GPU; "
                           "use attn_bwd elsewhere")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"gluon_dkdv: q and k must be (B, H, N, d), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon_dkdv: q must be bf16 or fp16, got {q.dtype}")
    b, h, n, d = q.shape
    hk = k.shape[1]
    if hk < 1 or h % hk:
        raise ValueError(f"gluon_dkdv: q's heads ({h}) must be a multiple of k's ({hk})")
    _check("do", do, q)
    for name, x in (("k", k), ("v", v)):
        _check(name, x, q, hk)
    if d not in (64, 128):
        raise ValueError(f"gluon_dkdv: head dim must be 64 or 128, got {d}")
    if num_warps not in (4, 8) or block_n != 16 * num_warps:
        raise ValueError(f"gluon_dkdv: need num_warps in (4, 8) and block_n == 16*num_warps, "
                         f"got block_n={block_n}, num_warps={num_warps}")
    if block_m not in (32, 64, 128) or block_n % block_m:
        raise ValueError(f"gluon_dkdv: block_m must be 32, 64 or 128 and divide block_n, "
                         f"got {block_m}")
    if n % block_n:
        raise ValueError(f"gluon_dkdv: sequence length must be a multiple of block_n={block_n}, "
                         f"got {n}")
    for name, x in (("lse", lse), ("delta", delta)):
        if x.shape != (b, h, n) or x.dtype != torch.float32:
            raise ValueError(f"gluon_dkdv: {name} must be float32 of shape {(b, h, n)}, "
                             f"got {x.dtype} {tuple(x.shape)}")
    if b * h * n >= 2 ** 31:
        raise ValueError(f"gluon_dkdv: B*H*N must be < 2**31 (int32 TMA coordinates), got {b * h * n}")
    scale = d ** -0.5 if scale is None else float(scale)
    q2, do2 = (x.contiguous().view(b * h * n, d) for x in (q, do))
    k2, v2 = (x.contiguous().view(b * hk * n, d) for x in (k, v))
    if out is None:
        dk, dv = torch.empty_like(k2), torch.empty_like(k2)
    else:
        for name, x in zip(("out[0]", "out[1]"), out):
            _check(name, x, q, hk)
            if not x.is_contiguous():
                raise ValueError(f"gluon_dkdv: {name} must be contiguous")
        dk, dv = (x.view(b * hk * n, d) for x in out)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    lay_m = gl.NVMMASharedLayout.get_default_for([block_m, d], gdt)
    lay_n = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, d], lay_m)
    do_desc = TensorDescriptor(do2, list(do2.shape), list(do2.stride()), [block_m, d], lay_m)
    k_desc, v_desc, dk_desc, dv_desc = (
        TensorDescriptor(x, list(x.shape), list(x.stride()), [block_n, d], lay_n)
        for x in (k2, v2, dk, dv))
    grid = (n // block_n, b * hk)
    _gluon_dkdv_kernel[grid](
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse.contiguous(),
        delta.contiguous(), n, scale, scale * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=d, CAUSAL=bool(causal), GROUPS=h // hk, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": int(maxnreg)}))
    return dk.view(b, hk, n, d), dv.view(b, hk, n, d)
