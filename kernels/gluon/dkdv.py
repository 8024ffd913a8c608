"""First-backward dK/dV pass in Gluon (TMA + async wgmma), sm_90.

``attn_bwd`` launches it instead of the Triton ``_attn_bwd_dkdv_kernel`` (dkdv.py) where
the plan (plan.py, with :func:`..scope.dkdv_reason`) finds the call in its scope, with the
tiles of ``configs.GLUON``; everywhere else the Triton pass runs. It matches float64 autograd
as closely as the Triton pass (tests/test_gluon_gpu.py); its timings are in
docs/benchmarks.md.

One program owns one key tile (BLOCK_N keys of one (batch, kv head)): K and V come to shared
memory once by TMA; the query tiles that can see the keys, of every query head that reads
this kv head (GQA: H_q / H_kv of them, one sweep after the other), stream through a two-slot
ring of Q / dO tiles (TMA, one mbarrier per slot, the next tile's copy issued before the current
tile's MMAs). Per query tile, in (keys x queries) orientation, with τ = ``scale``:

    Sᵀ = K Qᵀ,  Pᵀ = exp2(τ·log2e·Sᵀ − L·log2e),  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ∘(dPᵀ − D)
    dV += Pᵀ dO,   dK += dSᵀ Q        (dK scaled by τ at the end)

The four products are ``warpgroup_mma`` (Sᵀ and dPᵀ issued together asynchronously; Pᵀ and
dSᵀ as register A operands). Two program shapes:

- single partition (``consumers=1``): the warps issue the TMA copies themselves;
- two consumer partitions (``consumers=2``, 8 warps): a one-warp producer partition issues
  the K / V copy and fills a ring of ``stages`` Q / dO slots; the program owns ``block_n``
  keys and each of two 4-warp consumer partitions owns ``block_n / 2`` of them (its own K,
  V, dK, dV), both reading every slot, which is refilled once both have released it (its
  "empty" barrier counts two arrivals), so each query tile is loaded once for both. Under
  causal masking the ring holds the query tiles that see the program's first key; the
  second partition's products over the first ones are zero.

Scope: scope.py (``dkdv_reason``); :func:`gluon_dkdv` checks its arguments (a ValueError
naming the argument), :func:`launch_dkdv` does not.
"""

from __future__ import annotations

import torch

from . import common as _gc
from .common import *  # noqa: F401,F403 - the pass header: Gluon's names for the kernels, LOG2E
from .common import CONSUMER_REGS, PRODUCER_REGS, check_args, flat, tile_descriptors

#: Gluon's Hopper ops import (common.py); the warp-specialised kernel (``consumers=2``) also
#: needs the list-form ``warp_specialize`` (:data:`HAVE_WARP_SPECIALIZE`)
HAVE_GLUON = _gc.HAVE_GLUON
HAVE_WARP_SPECIALIZE = _gc.HAVE_WARP_SPECIALIZE

BLOCK_N = 128
BLOCK_M = 64
NUM_WARPS = 8
#: ring slots of the warp-specialised kernel (``consumers=2``)
STAGES = 2


def available(device=None) -> bool:
    """True where Gluon's Hopper ops import and the CUDA device is sm_90 (Hopper)."""
    return _gc.available(device, warp_specialize=False)


if HAVE_GLUON:

    @gluon.jit
    def _query_rowvecs(LSE, DELTA, qrow, m0, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
        """(positions, L·log2e, D) of query tile [m0, m0 + BLOCK_M) of the head whose first
        flat row is ``qrow``, laid out along the queries of a (keys x queries) tile; rows that
        see no key (L = −inf) get +inf, so their P is 0."""
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        lse2 = gl.load(LSE + qrow + offs_m) * 1.4426950408889634
        lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
        di = gl.load(DELTA + qrow + offs_m)
        return offs_m, lse2, di

    @gluon.jit
    def _tile_products(k_smem, v_smem, q_s, do_s, lse2, di, offs_m, offs_n, s_zero, dk, dv,
                       qk_scale2, CAUSAL: gl.constexpr, op_layout: gl.constexpr):
        """(dK, dV) after one query tile (its Q, dO in ``q_s``, ``do_s``): Sᵀ, dPᵀ, then
        dV += Pᵀ dO and dK += dSᵀ Q, every product complete on return."""
        dtype: gl.constexpr = q_s.dtype
        st = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
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
        return dk, dv

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

        lo, n_tiles = query_range(n0, N, BLOCK_M, CAUSAL)
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
            qrow, m0 = query_row(qrow0, i, lo, n_tiles, N, BLOCK_M, GROUPS)
            qrow = qrow - m0  # the head's first row
            if i + 1 < total:  # prefetch the next tile into the other slot
                nxt = 1 - slot
                nrow, _ = query_row(qrow0, i + 1, lo, n_tiles, N, BLOCK_M, GROUPS)
                mbarrier.expect(ld_bar.index(nxt), tile_bytes)
                _tma_load(q_desc, [nrow, 0], ld_bar.index(nxt), q_smem.index(nxt))
                _tma_load(do_desc, [nrow, 0], ld_bar.index(nxt), do_smem.index(nxt))
            offs_m, lse2, di = _query_rowvecs(LSE, DELTA, qrow, m0, BLOCK_M, s_layout)
            mbarrier.wait(ld_bar.index(slot), (i // 2) & 1)
            q_s = q_smem.index(slot)
            do_s = do_smem.index(slot)

            dk, dv = _tile_products(k_smem, v_smem, q_s, do_s, lse2, di, offs_m, offs_n, s_zero,
                                    dk, dv, qk_scale2, CAUSAL, op_layout)

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


    # ----------------------------------------------------------------- warp-specialised

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring, do_ring,
                       kv_bar, ready, empty, row0, n0, N, GROUPS: gl.constexpr,
                       BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMERS: gl.constexpr):
        """Producer partition (one warp): the K / V tiles of every consumer partition (rows
        from ``row0 + n0``, consumer c's from BLOCK_N·c on, in buffer index c), then the Q /
        dO tiles that see any of these keys into the ring, each slot refilled once every
        consumer partition has released it."""
        sub: gl.constexpr = k_desc.block_type.shape[0]
        mbarrier.expect(kv_bar, CONSUMERS * (k_desc.block_type.nbytes +
                                             v_desc.block_type.nbytes))
        for c in gl.static_range(CONSUMERS):
            _tma_load(k_desc, [row0 + n0 + c * sub, 0], kv_bar, k_smem.index(c))
            _tma_load(v_desc, [row0 + n0 + c * sub, 0], kv_bar, v_smem.index(c))
        tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        lo, n_tiles = query_range(n0, N, BLOCK_M, CAUSAL)
        for i in range(GROUPS * n_tiles):
            slot = i % STAGES
            # a fresh barrier counts as having completed the phase before phase 0, so the
            # first pass over the ring does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            qrow, _ = query_row(row0 * GROUPS, i, lo, n_tiles, N, BLOCK_M, GROUPS)
            mbarrier.expect(ready.index(slot), tile_bytes)
            _tma_load(q_desc, [qrow, 0], ready.index(slot), q_ring.index(slot))
            _tma_load(do_desc, [qrow, 0], ready.index(slot), do_ring.index(slot))

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, LSE, DELTA, k_smem, v_smem, q_ring, do_ring, kv_bar,
                       ready, empty, row0, nq0, n0, N, scale, qk_scale2,
                       GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr):
        """Consumer partition (``num_warps`` warps) owning key tile [n0, n0 + BLOCK_N) (its
        K, V in ``k_smem``, ``v_smem``): the products of every query tile of the ring (those
        that see the program's keys from ``nq0``; under causal masking the first ones may
        see none of this partition's keys, their products are zero), each slot released once
        its products are done, then dK·τ, dV by TMA (staged through the K, V buffers)."""
        dtype: gl.constexpr = q_ring.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        lo, n_tiles = query_range(nq0, N, BLOCK_M, CAUSAL)
        total = GROUPS * n_tiles  # the query tiles of every head of the group
        qrow0 = row0 * GROUPS  # first query row of the group
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(kv_bar, 0)
        for i in range(total):
            slot = i % STAGES
            qrow, m0 = query_row(qrow0, i, lo, n_tiles, N, BLOCK_M, GROUPS)
            qrow = qrow - m0  # the head's first row
            offs_m, lse2, di = _query_rowvecs(LSE, DELTA, qrow, m0, BLOCK_M, s_layout)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q_s = q_ring.index(slot)
            do_s = do_ring.index(slot)

            dk, dv = _tile_products(k_smem, v_smem, q_s, do_s, lse2, di, offs_m, offs_n, s_zero,
                                    dk, dv, qk_scale2, CAUSAL, op_layout)
            mbarrier.arrive(empty.index(slot), count=1)  # its products are complete

        k_smem.store((dk * scale).to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [row0 + n0, 0], k_smem)
        _tma_store(dv_desc, [row0 + n0, 0], v_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gluon_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA,
                              N, scale, qk_scale2, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                              CAUSAL: gl.constexpr, GROUPS: gl.constexpr,
                              STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              num_warps: gl.constexpr):
        """Warp-specialised: as ``_gluon_dkdv_kernel`` with a one-warp TMA producer partition
        and CONSUMERS consumer partitions of ``num_warps`` warps each. The program owns keys
        [CONSUMERS·BLOCK_N·program_id(0), + CONSUMERS·BLOCK_N), consumer c the key tile
        BLOCK_N·c of them; the producer loads each Q / dO tile once into a ring of STAGES
        slots that all consumers read (a slot's "empty" barrier counts one release per
        consumer)."""
        nq0 = gl.program_id(0) * (CONSUMERS * BLOCK_N)
        row0 = gl.program_id(1) * N  # TMA coordinates are int32 (checked by the wrapper)
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, LSE, DELTA, k_smem.index(0),
                                  v_smem.index(0), q_ring, do_ring, kv_bar, ready, empty, row0,
                                  nq0, nq0, N, scale, qk_scale2, GROUPS, BLOCK_M, BLOCK_N,
                                  HEAD_DIM, CAUSAL, STAGES, num_warps)),
                (_dkdv_consumer, (dk_desc, dv_desc, LSE, DELTA, k_smem.index(1),
                                  v_smem.index(1), q_ring, do_ring, kv_bar, ready, empty, row0,
                                  nq0, nq0 + BLOCK_N, N, scale, qk_scale2, GROUPS, BLOCK_M,
                                  BLOCK_N, HEAD_DIM, CAUSAL, STAGES, num_warps)),
                (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring,
                                  do_ring, kv_bar, ready, empty, row0, nq0, N, GROUPS, BLOCK_M,
                                  CAUSAL, STAGES, CONSUMERS)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, LSE, DELTA, k_smem.index(0),
                                  v_smem.index(0), q_ring, do_ring, kv_bar, ready, empty, row0,
                                  nq0, nq0, N, scale, qk_scale2, GROUPS, BLOCK_M, BLOCK_N,
                                  HEAD_DIM, CAUSAL, STAGES, num_warps)),
                (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring,
                                  do_ring, kv_bar, ready, empty, row0, nq0, N, GROUPS, BLOCK_M,
                                  CAUSAL, STAGES, CONSUMERS)),
            ], [1], [PRODUCER_REGS])


def _prepare(q, k, v, do, lse, delta, scale, causal, block_n, block_m, num_warps, out,
             consumers=1):
    """Kernel arguments and meta-parameters of one launch, no checks, any device
    (scripts/kernels/gluon_compile_sm90.py builds CPU ones): contiguous (B, H, N, d) inputs, ``out``
    the contiguous (dk, dv) to write into. ``block_n`` / ``num_warps``: the keys / consumer
    warps of a program (each of the ``consumers`` partitions gets block_n / consumers keys
    and num_warps / consumers warps)."""
    b, h, n, d = q.shape
    hk = k.shape[1]
    q2, do2 = flat(q), flat(do)
    k2, v2 = flat(k), flat(v)
    dk, dv = (x.view(b * hk * n, d) for x in out)
    q_desc, do_desc = tile_descriptors((q2, do2), block_m, d, q.dtype)
    k_desc, v_desc, dk_desc, dv_desc = tile_descriptors((k2, v2, dk, dv), block_n // consumers,
                                                        d, q.dtype)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse.contiguous(),
            delta.contiguous(), n, scale, scale * LOG2E)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n // consumers, HEAD_DIM=d,
                CAUSAL=bool(causal), GROUPS=h // hk, num_warps=num_warps // consumers)
    return args, meta


def launch_dkdv(q, k, v, do, lse, delta, *, scale, causal, block_n, block_m, num_warps,
                consumers=1, stages=STAGES, maxnreg=None, out):
    """Launch the pass without checks (the plan has verified the call): contiguous
    (B, H, N, d) inputs, ``out`` the contiguous (dk, dv) to write into. ``consumers=2``:
    the warp-specialised kernel (a TMA producer warp and two consumer partitions of
    num_warps / 2 warps, block_n / 2 keys each, sharing a ring of ``stages`` Q / dO slots);
    ``consumers=1``: one partition with a two-slot ring (``stages`` unused)."""
    b, h, n, d = q.shape
    hk = k.shape[1]
    args, meta = _prepare(q, k, v, do, lse, delta, scale, causal, block_n, block_m, num_warps,
                          out, consumers)
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    grid = (n // block_n, b * hk)
    if consumers > 1:
        _gluon_dkdv_ws_kernel[grid](*args, STAGES=stages, CONSUMERS=consumers,
                                    CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                                    **meta)
    else:
        _gluon_dkdv_kernel[grid](*args, **meta)
    return out


def gluon_dkdv(q, k, v, do, lse, delta, *, scale=None, causal=False, block_n=BLOCK_N,
               block_m=BLOCK_M, num_warps=NUM_WARPS, consumers=1, stages=STAGES,
               maxnreg=None, out=None):
    """dK, dV of softmax attention from the forward's ``lse`` and ``delta`` = rowsum(dO∘O).

    q, do: (B, H_q, N, d) and k, v: (B, H_kv, N, d), bf16/fp16 on one sm_90 device, H_q a
    multiple of H_kv (GQA: query head h reads kv head h // (H_q / H_kv)); lse, delta:
    (B, H_q, N) float32 (natural-log LSE, as ``attn_fwd`` returns it). Returns (dk, dv),
    each (B, H_kv, N, d) in q's dtype, summed over the query heads of each kv head. Inputs
    that are not contiguous are copied. ``block_n`` keys per program (16 per warp:
    block_n == 16·num_warps, num_warps 4 or 8), ``block_m`` queries per step (dividing
    block_n); ``consumers=2`` (8 warps) adds a one-warp TMA producer partition and splits
    the key tile between two 4-warp consumer partitions (block_n / 2 keys each) that share
    a ring of ``stages`` Q / dO slots (2 to 4; block_m dividing block_n / 2), so each query
    tile is loaded once for both; ``maxnreg`` caps ptxas's registers per thread (None: no
    cap). ``out``: optional (dk, dv) pair of contiguous tensors like k to write into.
    """
    fn = "gluon_dkdv"
    b, h, n, d = check_args(fn, q, k, (("do", do, False), ("k", k, True),
                                       ("v", v, True)),
                            (("lse", lse), ("delta", delta)),
                            None if out is None else (("out[0]", out[0], True),
                                                      ("out[1]", out[1], True)),
                            block_n=block_n, block_m=block_m, num_warps=num_warps,
                            per_warp="block_n", stages=stages, available=available(q.device))
    if consumers not in (1, 2) or isinstance(consumers, bool) or (
            consumers == 2 and not (num_warps == 8 and (block_n // 2) % block_m == 0)):
        raise ValueError(f"{fn}: consumers must be 1, or 2 with num_warps=8 and block_m "
                         f"dividing block_n / 2, got consumers={consumers!r}, "
                         f"num_warps={num_warps}, block_n={block_n}, block_m={block_m}")
    scale = d ** -0.5 if scale is None else float(scale)
    if out is None:
        out = (torch.empty_like(k, memory_format=torch.contiguous_format),
               torch.empty_like(k, memory_format=torch.contiguous_format))
    return launch_dkdv(q, k, v, do, lse, delta, scale=scale, causal=causal, block_n=block_n,
                       block_m=block_m, num_warps=num_warps, consumers=consumers,
                       stages=stages, maxnreg=maxnreg, out=out)
