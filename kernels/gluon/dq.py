"""First-backward dQ pass in Gluon (TMA key-tile ring + async wgmma, optional warp
specialisation), sm_90: dQ = τ dS K and D = rowsum(dO∘O).

``attn_bwd`` launches it instead of the Triton ``_attn_bwd_dq_kernel`` (dq.py) where
the plan (plan.py, with :func:`..scope.dq_reason`) finds the call in its scope, with the
tiles of ``configs.GLUON``; everywhere else the Triton pass runs. Its outputs have the
Triton pass's format and layout, so the dK/dV pass that follows reads them unchanged: dQ
contiguous (B, H_q, N, d) in the input dtype, D float32 (B, H_q, N) (tests/test_gluon_gpu.py
compares both with the Triton pass and float64). It never forms ρ: the row-sum correction
is on for float32 only, which stays with the Triton pass.

One program owns one query tile (BLOCK_M queries of one (batch, query head)): Q and dO come
to shared memory once by TMA, D = rowsum(dO∘O) of its rows is formed from O and dO and
written, then the key tiles that the queries see stream through a ring of ``stages`` slots
of (K, V) tiles, one mbarrier per slot. Per key tile, with c = τ·log2e and per-query vectors
broadcast along the keys:

    S = Q Kᵀ,  P = exp2(c·S − L·log2e),  dP = dO Vᵀ,  dS = P∘(dP − D)
    dQ += dS K                                  (dQ scaled by τ at the end)

S and dP are issued together asynchronously (P is formed while dP is on the tensor cores);
dS enters dS K as a register A operand, K as the B operand read from the same ring slot as
Kᵀ for S. A slot is released once dS K is complete.

Program shapes (``warp_specialize``, ``consumers``):

- single partition (``warp_specialize=False``): the warps issue the TMA copies themselves
  (stages − 1 tiles in flight while one is consumed);
- warp-specialised (``warp_specialize=True``): a one-warp producer partition issues the Q /
  dO copies and the ring's copies, waiting on per-slot "free" barriers that the consumer
  warps release;
- two consumer partitions (``consumers=2``, with the producer): each of num_warps / 2 warps
  owns half the query tile and runs its own schedule over the shared K / V ring (a slot is
  free once both have released it), so that one's exponentials run while the other's
  products are on the tensor cores;
- ``defer`` (warp-specialised shapes): a partition waits for a tile's dS K only after it
  has issued the next tile's S and dP, and releases the tile's slot then.

Causal: the query tiles are taken longest row first (program 0 gets the last query tile);
only the key tiles that reach past a partition's first query are masked.

Scope: scope.py (``dq_reason``); :func:`gluon_attn_dq` checks its arguments (a ValueError
naming the argument), :func:`launch_dq` does not. GQA / MQA: query head h reads kv head
h // (H_q / H_kv). Not covered: varlen, window, N_q ≠ N_k, float32, ρ (the Triton pass).
"""

from __future__ import annotations

import torch

from . import common as _gc
from .common import *  # noqa: F401,F403 - the pass header: Gluon's names for the kernels, LOG2E
from .common import CONSUMER_REGS, PRODUCER_REGS, check_args, flat, tile_descriptors

#: Gluon's Hopper ops and its list-form ``warp_specialize`` import (common.py)
HAVE_GLUON = _gc.HAVE_PASSES

BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
STAGES = 2

available = _gc.available


if HAVE_GLUON:

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_ring, v_ring, bar, slot, row):
        """K and V rows [row, row + BLOCK_N) into ring slot ``slot``, completing on ``bar``."""
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, 0], bar, k_ring.index(slot))
        _tma_load(v_desc, [row, 0], bar, v_ring.index(slot))

    @gluon.jit
    def _load_q_do(q_desc, do_desc, q_s, do_s, bar, row, CONSUMERS: gl.constexpr):
        """The CONSUMERS Q and dO tiles from row ``row`` (one per consumer partition,
        consecutive) into ``q_s``, ``do_s``, completing on ``bar``."""
        sub: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(bar, 2 * CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            _tma_load(q_desc, [row + c * sub, 0], bar, q_s.index(c))
            _tma_load(do_desc, [row + c * sub, 0], bar, do_s.index(c))

    @gluon.jit
    def _delta_rows(O, DO, DELTA, row, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                    num_warps: gl.constexpr):
        """D = rowsum(dO∘O) of flat rows [row, row + BLOCK_M) in float32, written to DELTA
        and returned (a row vector of a blocked layout)."""
        blk: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                             warps_per_cta=[num_warps, 1], order=[1, 0])
        rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
        offs = gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
        o = gl.load(O + offs).to(gl.float32)
        do = gl.load(DO + offs).to(gl.float32)
        delta = gl.sum(o * do, axis=1)
        gl.store(DELTA + rows, delta)
        return delta

    @gluon.jit
    def _issue_scores(q_s, do_s, k_s, v_s, s_zero):
        """Issue S = Q Kᵀ and dP = dO Vᵀ of one key tile (asynchronous, two groups)."""
        st = warpgroup_mma(q_s, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_s, v_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return st, dpt

    @gluon.jit
    def _ds_operand(st, dpt, l2, di, m0, n0, qk_scale2, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                    op_layout: gl.constexpr, dtype: gl.constexpr):
        """dS = P∘(dP − D) of key tile [n0, n0 + BLOCK_N) as the A operand of dS K, from S
        and dP in flight (the last two groups issued): P is formed while dP completes."""
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))  # dP in flight
        p = gl.exp2(st * qk_scale2 - l2)
        if CAUSAL:
            if n0 + BLOCK_N > m0:  # only the diagonal tiles hold masked pairs
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                vis = gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0)
                p = gl.where(vis, p, 0.0)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        return gl.convert_layout((p * (dpt - di)).to(dtype), op_layout)

    @gluon.jit
    def _dq_consumer(dq_desc, O, DO, LSE, DELTA, q_s, do_s, k_ring, v_ring, q_bar, ready,
                     free, row0, krow0, m0, n_tiles, scale, qk_scale2, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                     STAGES: gl.constexpr, WS: gl.constexpr, DEFER: gl.constexpr, k_desc,
                     v_desc, num_warps: gl.constexpr):
        """D of the BLOCK_M queries from ``m0`` (their Q, dO in ``q_s``, ``do_s``), then key
        tiles [0, n_tiles) and the epilogue: dQ·τ by TMA (staged through the Q buffer).
        Query rows from ``row0``, key rows from ``krow0`` (the kv head of the query head
        under GQA). WS: the ring is filled by the producer partition and each slot released
        on ``free`` (by every consumer partition); otherwise this partition issues the
        copies itself. DEFER (with WS): the wait for dS K of a tile comes after the next
        tile's S and dP are issued (its slot is released then), so that dS K runs while the
        next tile's products are queued."""
        dtype: gl.constexpr = q_s.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        if not WS:  # fill all slots but one
            for s in gl.static_range(STAGES - 1):
                if s < n_tiles:
                    _load_kv(k_desc, v_desc, k_ring, v_ring, ready.index(s), s,
                             krow0 + s * BLOCK_N)
        delta = _delta_rows(O, DO, DELTA, row0 + m0, BLOCK_M, HEAD_DIM, num_warps)
        di = gl.expand_dims(gl.convert_layout(delta, row_s), 1)
        lse = gl.load(LSE + row0 + m0 + gl.arange(0, BLOCK_M, layout=row_s))
        l2 = lse * 1.4426950408889634
        l2 = gl.expand_dims(gl.where(l2 == float("-inf"), float("inf"), l2), 1)  # P = 0
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(q_bar, 0)
        if DEFER:
            mbarrier.wait(ready.index(0), 0)
            st, dpt = _issue_scores(q_s, do_s, k_ring.index(0), v_ring.index(0), s_zero)
            ds_op = _ds_operand(st, dpt, l2, di, m0, 0, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL,
                                s_layout, op_layout, dtype)
            acc = warpgroup_mma(ds_op, k_ring.index(0), acc, is_async=True)
            for i in range(1, n_tiles):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                st, dpt = _issue_scores(q_s, do_s, k_ring.index(slot), v_ring.index(slot),
                                        s_zero)
                # dS K of the previous tile is complete: hand its slot back
                acc, ds_op = warpgroup_mma_wait(num_outstanding=2, deps=(acc, ds_op))
                mbarrier.arrive(free.index((i - 1) % STAGES), count=1)
                ds_op = _ds_operand(st, dpt, l2, di, m0, i * BLOCK_N, qk_scale2, BLOCK_M,
                                    BLOCK_N, CAUSAL, s_layout, op_layout, dtype)
                acc = warpgroup_mma(ds_op, k_ring.index(slot), acc, is_async=True)
            acc, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ds_op))
            mbarrier.arrive(free.index((n_tiles - 1) % STAGES), count=1)
        else:
            for i in range(n_tiles):
                if not WS:  # refill the slot consumed (and waited for) in the previous tile
                    nxt = i + STAGES - 1
                    if nxt < n_tiles:
                        ns = nxt % STAGES
                        _load_kv(k_desc, v_desc, k_ring, v_ring, ready.index(ns), ns,
                                 krow0 + nxt * BLOCK_N)
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                k_s = k_ring.index(slot)
                st, dpt = _issue_scores(q_s, do_s, k_s, v_ring.index(slot), s_zero)
                ds_op = _ds_operand(st, dpt, l2, di, m0, i * BLOCK_N, qk_scale2, BLOCK_M,
                                    BLOCK_N, CAUSAL, s_layout, op_layout, dtype)
                acc = warpgroup_mma(ds_op, k_s, acc, is_async=True)
                acc, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ds_op))
                if WS:  # its products are complete: the producer may refill the slot
                    mbarrier.arrive(free.index(slot), count=1)
        q_s.store((acc * scale).to(dtype))
        fence_async_shared()
        _tma_store(dq_desc, [row0 + m0, 0], q_s)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_ring, v_ring, q_bar, ready,
                     free, row0, krow0, m0, n_tiles, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """Producer partition (one warp): the Q and dO tiles of each consumer partition,
        then key tiles [0, n_tiles) into the ring, each slot refilled once the consumers
        have released it."""
        _load_q_do(q_desc, do_desc, q_s, do_s, q_bar, row0 + m0, CONSUMERS)
        for i in range(n_tiles):
            slot = i % STAGES
            # a fresh barrier counts as having completed the phase before phase 0, so the
            # first pass over the ring does not wait
            mbarrier.wait(free.index(slot), ((i // STAGES) & 1) ^ 1)
            _load_kv(k_desc, v_desc, k_ring, v_ring, ready.index(slot), slot,
                     krow0 + i * BLOCK_N)

    @gluon.jit
    def _gluon_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, O, DO, LSE, DELTA, N, GROUPS,
                         scale, qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                         WS: gl.constexpr, CONSUMERS: gl.constexpr, DEFER: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
        """dQ and D of query tile ``program_id(0)`` (BLOCK_M queries) of (batch·query head)
        ``program_id(1)``. The descriptors view (B·H·N, d) tensors (H = H_q for Q, dO, dQ,
        H_kv for K and V; (batch·query head) j reads (batch·kv head) j // GROUPS); Q, dO and
        dQ tiles have BLOCK_M / CONSUMERS rows. O and DO are the flat (B·H_q·N, d) tensors
        (read for D), LSE the flat natural-log row log-sum-exp and DELTA the flat
        (B·H_q·N,) float32 output D. WS adds the one-warp TMA producer; CONSUMERS = 2
        (with WS) splits the query tile between two consumer partitions of ``num_warps``
        warps each, which share the K / V ring; DEFER (with WS) defers each tile's dS K
        wait past the next tile's S and dP."""
        row0 = gl.program_id(1) * N  # TMA coordinates are int32 (checked by the wrapper)
        krow0 = (gl.program_id(1) // GROUPS) * N
        m0 = row_tile(N, BLOCK_M, CAUSAL)
        n_tiles = key_tiles(m0, N, BLOCK_M, BLOCK_N, CAUSAL)
        SUB: gl.constexpr = BLOCK_M // CONSUMERS
        dtype: gl.constexpr = q_desc.dtype
        q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], q_desc.layout)
        do_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], do_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(free.index(s), count=CONSUMERS)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_dq_consumer, (dq_desc, O, DO, LSE, DELTA, q_s.index(0), do_s.index(0),
                                k_ring, v_ring, q_bar, ready, free, row0, krow0, m0, n_tiles,
                                scale, qk_scale2, SUB, BLOCK_N, HEAD_DIM, CAUSAL, STAGES,
                                True, DEFER, k_desc, v_desc, num_warps)),
                (_dq_consumer, (dq_desc, O, DO, LSE, DELTA, q_s.index(1), do_s.index(1),
                                k_ring, v_ring, q_bar, ready, free, row0, krow0, m0 + SUB,
                                n_tiles, scale, qk_scale2, SUB, BLOCK_N, HEAD_DIM, CAUSAL,
                                STAGES, True, DEFER, k_desc, v_desc, num_warps)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_ring, v_ring,
                                q_bar, ready, free, row0, krow0, m0, n_tiles, BLOCK_N, STAGES,
                                CONSUMERS)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        elif WS:
            gl.warp_specialize([
                (_dq_consumer, (dq_desc, O, DO, LSE, DELTA, q_s.index(0), do_s.index(0),
                                k_ring, v_ring, q_bar, ready, free, row0, krow0, m0, n_tiles,
                                scale, qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, STAGES,
                                True, DEFER, k_desc, v_desc, num_warps)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_ring, v_ring,
                                q_bar, ready, free, row0, krow0, m0, n_tiles, BLOCK_N, STAGES,
                                CONSUMERS)),
            ], [1], [PRODUCER_REGS])
        else:
            _load_q_do(q_desc, do_desc, q_s, do_s, q_bar, row0 + m0, CONSUMERS)
            _dq_consumer(dq_desc, O, DO, LSE, DELTA, q_s.index(0), do_s.index(0), k_ring,
                         v_ring, q_bar, ready, free, row0, krow0, m0, n_tiles, scale,
                         qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, STAGES, False,
                         False, k_desc, v_desc, num_warps)


def _prepare(q, k, v, o, do, lse, scale, causal, block_n, block_m, num_warps, stages,
             consumers=1, out=None):
    """Kernel arguments, meta-parameters and the outputs (dq flat (B·H_q·N, d), delta flat
    (B·H_q·N,) float32; written into ``out`` = (dq, delta) if given) of one launch, no
    checks, any device (scripts/kernels/gluon_compile_sm90.py builds CPU ones). ``num_warps``: all
    consumer warps (each of the ``consumers`` partitions gets num_warps / consumers)."""
    b, h, n, d = q.shape
    q2, k2, v2, o2, do2 = flat(q), flat(k), flat(v), flat(o), flat(do)
    if out is None:
        dq2 = torch.empty_like(q2)
        delta = torch.empty(b * h * n, dtype=torch.float32, device=q.device)
    else:
        dq2, delta = out[0].view(b * h * n, d), out[1].view(-1)
    q_desc, do_desc, dq_desc = tile_descriptors((q2, do2, dq2), block_m // consumers, d,
                                                q.dtype)
    k_desc, v_desc = tile_descriptors((k2, v2), block_n, d, q.dtype)
    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, o2, do2, lse.reshape(-1), delta, n,
            h // k.shape[1], scale, scale * LOG2E)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, CAUSAL=bool(causal),
                STAGES=stages, CONSUMERS=consumers, num_warps=num_warps // consumers)
    return args, meta, (dq2, delta)


def launch_dq(q, k, v, o, do, lse, *, scale, causal, block_n, block_m, num_warps, stages,
              warp_specialize=False, consumers=1, defer=False, maxnreg=None, out=None):
    """Launch the pass without checks (the plan or the public entry point has verified the
    call): contiguous (B, H_q, N, d) ``q``, ``o``, ``do``, (B, H_kv, N, d) ``k``, ``v``,
    contiguous float32 (B, H_q, N) ``lse``; ``out``: the contiguous (dq, delta) to write
    into ((B, H_q, N, d) and (B, H_q, N) float32), else allocated. Returns (dq, delta)
    flat: (B·H_q·N, d) and (B·H_q·N,)."""
    b, h, n, d = q.shape
    args, meta, outs = _prepare(q, k, v, o, do, lse, scale, causal, block_n, block_m,
                                num_warps, stages, consumers, out)
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    ws = bool(warp_specialize) or consumers > 1
    _gluon_dq_kernel[(n // block_m, b * h)](*args, WS=ws, DEFER=bool(defer) and ws,
                                            CONSUMER_REGS=CONSUMER_REGS,
                                            PRODUCER_REGS=PRODUCER_REGS, **meta)
    return outs


def gluon_attn_dq(q, k, v, o, do, lse, *, scale=None, causal=False, block_m=BLOCK_M,
                  block_n=BLOCK_N, num_warps=NUM_WARPS, stages=STAGES, warp_specialize=False,
                  consumers=1, defer=False, maxnreg=None):
    """dQ and D = rowsum(dO∘O) of softmax attention: the Triton dQ pass's results
    (``attn_bwd``'s dq and delta, without the ρ correction).

    q, o, do: (B, H_q, N, d) and k, v: (B, H_kv, N, d), bf16/fp16 on one sm_90 device, d 64
    or 128, H_q a multiple of H_kv (GQA: query head h reads kv head h // (H_q / H_kv)), N a
    multiple of ``block_m`` and ``block_n``; lse: contiguous (B, H_q, N) float32, the
    natural-log row log-sum-exp of τ Q Kᵀ (as ``attn_fwd`` returns it); ``causal``: query
    i sees keys j ≤ i. Returns (dq, delta): dq (B, H_q, N, d) in q's dtype (τ dS K, τ =
    ``scale``, default d^-1/2), delta (B, H_q, N) float32. Inputs that are not contiguous
    are copied.

    ``block_m`` queries per program (16 per warp: block_m == 16·num_warps, num_warps 4 or
    8), ``block_n`` keys per step (32, 64 or 128), ``stages`` ring slots (2 to 4),
    ``warp_specialize`` adds a one-warp TMA producer partition, ``consumers=2`` (with
    ``warp_specialize`` and 8 warps) splits the query tile between two 4-warp consumer
    partitions that share the K / V ring, ``defer`` (with ``warp_specialize``) waits for
    each tile's dS K only after the next tile's S and dP are issued, ``maxnreg`` caps
    ptxas's registers per thread (None: no cap).
    """
    fn = "gluon_attn_dq"
    b, h, n, d = check_args(fn, q, k, (("k", k, True), ("v", v, True), ("o", o, False),
                                       ("do", do, False)), (("lse", lse),), None,
                            block_n=block_n, block_m=block_m, num_warps=num_warps,
                            per_warp="block_m", stages=stages, available=available(q.device))
    if b * h * n == 0:
        raise ValueError(f"{fn}: q has no rows (shape {tuple(q.shape)}); use attn_bwd for "
                         "empty inputs")
    if consumers not in (1, 2) or (consumers == 2 and not (warp_specialize and num_warps == 8)):
        raise ValueError(f"{fn}: consumers must be 1, or 2 with warp_specialize=True and "
                         f"num_warps=8, got consumers={consumers}, "
                         f"warp_specialize={warp_specialize}, num_warps={num_warps}")
    if defer and not warp_specialize:
        raise ValueError(f"{fn}: defer=True needs warp_specialize=True")
    scale = d ** -0.5 if scale is None else float(scale)
    dq, delta = launch_dq(q, k, v, o, do, lse, scale=scale, causal=causal, block_n=block_n,
                          block_m=block_m, num_warps=num_warps, stages=stages,
                          warp_specialize=warp_specialize, consumers=consumers, defer=defer,
                          maxnreg=maxnreg)
    return dq.view(b, h, n, d), delta.view(b, h, n)
