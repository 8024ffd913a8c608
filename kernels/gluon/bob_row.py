"""BoB row passes in Gluon (TMA key-tile ring + async wgmma, optional warp
specialisation), sm_90: the direct pass (Q̄, dŌ) and the statistics pass (α, E + αD).

``attn_bob`` launches them instead of the Triton ``_bob_stats_kernel`` / ``_bob_direct_kernel``
(bob_row.py) where the plan (plan.py, with :func:`..scope.bob_stats_reason` and
:func:`..scope.bob_direct_reason`) finds the call in their scope, with the tiles of
``configs.GLUON``; everywhere else the Triton passes run. Q̄, dŌ are as close to float64
double backward as the Triton direct pass's, α, E + αD agree with the Triton statistics
pass's to float32 rounding (tests/test_gluon_gpu.py); timings are in docs/benchmarks.md.

Same inputs and outputs as the Triton passes they stand in for (bob.py,
``_bob_direct_kernel`` and ``_bob_stats_kernel``; bob-math.md): from Q, K, V, dO, the
cotangents U_Q, U_K, U_V, the forward's L and D = rowsum(dO∘O),

- :func:`gluon_bob_stats` writes α = rowsum(P∘G) and E + αD = rowsum(P∘(G∘dP + B)) − αD
  of every query row;
- :func:`gluon_bob_direct` (α, E + αD known) writes Q̄ and dŌ of every query row.

One program owns one query tile (BLOCK_M queries of one (batch, head)): Q, dO, U_Q come to
shared memory once by TMA, the key tiles that the queries see stream through a ring of
``stages`` slots of (K, V, U_K, U_V) tiles, one mbarrier per slot. The row vectors (L·log2e,
D, α, E + αD) stay in registers (two values per thread per vector). Per key tile, in
(queries x keys) orientation, with τ = ``scale``, per-query vectors broadcast along keys:

    S = Q Kᵀ                  P = exp2(τ·log2e·S − L·log2e)
    G = τ (Q U_Kᵀ + U_Q Kᵀ) − α                 H = P∘G
    dP = dO Vᵀ,  B = dO U_Vᵀ                    dS = P∘(dP − D)
    R = G∘dS + P∘(B − (E + αD))
    dŌ += H V + P U_V,   Q̄ += R K + dS U_K      (Q̄ scaled by τ at the end)

Nine ``warpgroup_mma`` per tile pair in the direct pass: the four score-shaped products S,
G (two) and B are issued together asynchronously; S and G are waited for first, so P and H
are formed while B is on the tensor cores, then dŌ's two products and dP are issued before
B is waited for (with two consumer partitions, except at d = 64 with 32-key steps, dP is
issued once the dŌ products are complete, to fit 240 registers per thread; the other
partition's products fill the tensor cores meanwhile). H, P, R and dS enter as register A
operands. The statistics pass issues the five score-shaped products only and keeps three
row sums.

Three program shapes (the first two as in bob_col.py, the third as in fwd.py):

- single partition (``warp_specialize=False``): every warp issues the TMA copies itself;
- warp-specialised (``warp_specialize=True``): a one-warp producer partition issues the
  Q/dO/U_Q copy and the ring's key-tile copies, waiting on per-slot "empty" barriers; the
  ``num_warps`` consumer warps wait on per-slot "ready" barriers, do the products and
  release each slot once its products are done;
- two consumer partitions (``consumers=2``, with the producer and 8 warps): each 4-warp
  partition owns half of the query tile (its own Q, dO, U_Q and accumulators) and runs the
  schedule above on its own; both read every key tile of the one ring (the producer loads
  it once per program, not once per partition), and a slot's "empty" barrier completes
  when both have released it. Causal: the first partition's rows see fewer key tiles than
  the second's; it releases the extra ones unread.

Causal: the query tiles are taken longest row first (program 0 gets the last query tile);
only the key tiles that reach past the tile's first query are masked.

Scope: scope.py (``bob_stats_reason``, ``bob_direct_reason``); :func:`gluon_bob_stats` and
:func:`gluon_bob_direct` check their arguments (a ValueError naming the argument),
:func:`launch_bob_row` does not. GQA: query head h reads kv head h // (H_q / H_kv). Not
covered: varlen, window, missing cotangents, the ρ row-sum correction, float32.

Triton versions: as bob_col.py (common.py looks up the TMA copy names; ``gl.warp_specialize``
with the 3.6 / 3.9 list form).
"""

from __future__ import annotations

import torch

from . import common as _gc
from .common import *  # noqa: F401,F403 - the pass header: Gluon's names for the kernels, LOG2E
from .common import (CONSUMER_REGS, PRODUCER_REGS, check_args, flat, lse_log2,
                     tile_descriptors)

#: Gluon's Hopper ops and its list-form ``warp_specialize`` import (common.py)
HAVE_GLUON = _gc.HAVE_PASSES

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
STAGES = 2

available = _gc.available


if HAVE_GLUON:

    @gluon.jit
    def _load_query_tiles(q_desc, do_desc, uq_desc, q_smem, do_smem, uq_smem, bar, row,
                          CONSUMERS: gl.constexpr):
        """Q, dO, U_Q of the CONSUMERS query sub-tiles from row ``row`` (one per consumer
        partition, consecutive, each of the descriptors' rows) to shared memory
        (``q_smem.index(c)`` ...), completing on ``bar``."""
        sub: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(bar, 3 * CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            _tma_load(q_desc, [row + c * sub, 0], bar, q_smem.index(c))
            _tma_load(do_desc, [row + c * sub, 0], bar, do_smem.index(c))
            _tma_load(uq_desc, [row + c * sub, 0], bar, uq_smem.index(c))

    @gluon.jit
    def _load_key_tile(k_desc, v_desc, uk_desc, uv_desc, k_ring, v_ring, uk_ring, uv_ring,
                       bar, slot, row):
        """K, V, U_K, U_V rows [row, row + BLOCK_N) into ring slot ``slot``, completing on
        ``bar``."""
        mbarrier.expect(bar, 4 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, 0], bar, k_ring.index(slot))
        _tma_load(v_desc, [row, 0], bar, v_ring.index(slot))
        _tma_load(uk_desc, [row, 0], bar, uk_ring.index(slot))
        _tma_load(uv_desc, [row, 0], bar, uv_ring.index(slot))

    @gluon.jit
    def _row_vec(ptr, row0, m0, BLOCK_M: gl.constexpr, layout: gl.constexpr):
        """Row vector ``ptr[row0 + m0 : row0 + m0 + BLOCK_M]`` as a [BLOCK_M, 1] column
        broadcast along the keys of a (queries x keys) tile."""
        offs = row0 + m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        return gl.expand_dims(gl.load(ptr + offs), 1)

    @gluon.jit
    def _scores(q_s, do_s, uq_s, k_s, v_s, uk_s, uv_s, l2, al, m0, n0, scale, qk_scale2,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                s_layout: gl.constexpr):
        """Issue S, G, B of key tile [n0, n0 + BLOCK_N); return (P, G − α, B) with B still
        in flight (one outstanding group)."""
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        kt = k_s.permute((1, 0))
        st = warpgroup_mma(q_s, kt, s_zero, use_acc=False, is_async=True)
        gt = warpgroup_mma(q_s, uk_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        gt = warpgroup_mma(uq_s, kt, gt, is_async=True)
        bt = warpgroup_mma(do_s, uv_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st, gt = warpgroup_mma_wait(num_outstanding=1, deps=(st, gt))  # B in flight
        p = gl.exp2(st * qk_scale2 - l2)
        if CAUSAL:
            if n0 + BLOCK_N > m0:  # only the diagonal tiles hold masked pairs
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                vis = gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0)
                p = gl.where(vis, p, 0.0)
        g = gt * scale - al
        return p, g, bt

    @gluon.jit
    def _direct_tile(q_s, do_s, uq_s, k_s, v_s, uk_s, uv_s, qb, dob, l2, di, al, ee, m0, n0,
                     scale, qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
                     LOW_REGS: gl.constexpr):
        """(Q̄, dŌ) after key tile [n0, n0 + BLOCK_N) (its K, V, U_K, U_V tiles in shared
        memory); every product is complete on return. LOW_REGS: dP is issued once the dŌ
        products are complete (their H, P operands and dP's accumulator are then never
        live together), for the 240 registers per thread of a consumer partition when two
        share the register file; otherwise dP runs alongside them."""
        dtype: gl.constexpr = q_s.dtype
        p, g, bt = _scores(q_s, do_s, uq_s, k_s, v_s, uk_s, uv_s, l2, al, m0, n0, scale,
                           qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
        h_op = gl.convert_layout((p * g).to(dtype), op_layout)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        dob = warpgroup_mma(h_op, v_s, dob, is_async=True)
        dob = warpgroup_mma(p_op, uv_s, dob, is_async=True)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        if LOW_REGS:  # dP once the dŌ products (and their H, P operands) are done
            bt = warpgroup_mma_wait(num_outstanding=2, deps=(bt,))  # dŌ (2) in flight
            tt = p * (bt - ee)  # P∘(B − (E + αD))
            dob, h_op, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(dob, h_op, p_op))
            dpt = warpgroup_mma(do_s, v_s.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        else:
            dpt = warpgroup_mma(do_s, v_s.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            bt = warpgroup_mma_wait(num_outstanding=3, deps=(bt,))  # dŌ (2), dP in flight
            tt = p * (bt - ee)  # P∘(B − (E + αD))
            dob, dpt, h_op, p_op = warpgroup_mma_wait(num_outstanding=0,
                                                      deps=(dob, dpt, h_op, p_op))
        ds = p * (dpt - di)  # dS
        r_op = gl.convert_layout((g * ds + tt).to(dtype), op_layout)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        qb = warpgroup_mma(r_op, k_s, qb, is_async=True)
        qb = warpgroup_mma(ds_op, uk_s, qb, is_async=True)
        qb, r_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(qb, r_op, ds_op))
        return qb, dob

    @gluon.jit
    def _stats_tile(q_s, do_s, uq_s, k_s, v_s, uk_s, uv_s, r_al, r_e, l2, m0, n0, scale,
                    qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr, s_layout: gl.constexpr):
        """Row sums (rowsum(P∘G), rowsum(P∘(G∘dP + B))) after key tile [n0, n0 + BLOCK_N)."""
        p, g, bt = _scores(q_s, do_s, uq_s, k_s, v_s, uk_s, uv_s, l2, 0.0, m0, n0, scale,
                           qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dpt = warpgroup_mma(do_s, v_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        pg = p * g
        r_al += gl.sum(pg, axis=1)
        bt = warpgroup_mma_wait(num_outstanding=1, deps=(bt,))  # dP in flight
        t = p * bt
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        r_e += gl.sum(pg * dpt + t, axis=1)
        return r_al, r_e

    @gluon.jit
    def _direct_epilogue(qb, dob, q_s, do_s, qb_desc, dob_desc, row, scale):
        """Q̄·τ and dŌ to HBM by TMA, staged through the (no longer read) Q and dO buffers."""
        dtype: gl.constexpr = q_s.dtype
        q_s.store((qb * scale).to(dtype))
        do_s.store(dob.to(dtype))
        fence_async_shared()
        _tma_store(qb_desc, [row, 0], q_s)
        _tma_store(dob_desc, [row, 0], do_s)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _row_consumer(qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, q_s, do_s, uq_s, k_ring,
                      v_ring, uk_ring, uv_ring, q_bar, ready, empty, row0, krow0, m0, n_tiles,
                      N, scale, qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STATS: gl.constexpr,
                      STAGES: gl.constexpr, WS: gl.constexpr, k_desc, v_desc, uk_desc,
                      uv_desc, LOW_REGS: gl.constexpr, num_warps: gl.constexpr):
        """The products of every key tile that query tile [m0, m0 + BLOCK_M) sees, then
        the epilogue: Q̄, dŌ by TMA (direct) or α, E + αD to ALPHA, EE (STATS); query rows
        from ``row0``, key rows from ``krow0`` (the kv head of the query head under GQA).
        ``n_tiles``: the key tiles that stream through the ring, at least the ones this
        tile sees (with two consumer partitions, causal: the first partition's rows see
        fewer keys than the program's tile; it takes the tiles past its own as they
        arrive and hands them back unread). WS: the ring is filled by the producer
        partition and each slot released on ``empty`` (by every consumer partition);
        otherwise this partition issues the copies itself (the next STAGES − 1 tiles in
        flight while one is consumed). LOW_REGS: the direct pass's schedule with fewer
        registers (:func:`_direct_tile`)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        mine = key_tiles(m0, N, BLOCK_M, BLOCK_N, CAUSAL)  # == n_tiles without WS
        if not WS:
            for s in gl.static_range(STAGES - 1):  # fill all slots but one
                if s < n_tiles:
                    _load_key_tile(k_desc, v_desc, uk_desc, uv_desc, k_ring, v_ring, uk_ring,
                                   uv_ring, ready.index(s), s, krow0 + s * BLOCK_N)
        l2 = _row_vec(LSE2, row0, m0, BLOCK_M, s_layout)
        di = _row_vec(DELTA, row0, m0, BLOCK_M, s_layout)
        if STATS:
            r_al = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
            r_e = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        else:
            al = _row_vec(ALPHA, row0, m0, BLOCK_M, s_layout)
            ee = _row_vec(EE, row0, m0, BLOCK_M, s_layout)
            qb = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
            dob = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(q_bar, 0)
        for i in range(mine):
            if not WS:  # refill the slot consumed (and waited for) in the previous iteration
                nxt = i + STAGES - 1
                if nxt < n_tiles:
                    ns = nxt % STAGES
                    _load_key_tile(k_desc, v_desc, uk_desc, uv_desc, k_ring, v_ring, uk_ring,
                                   uv_ring, ready.index(ns), ns, krow0 + nxt * BLOCK_N)
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if STATS:
                r_al, r_e = _stats_tile(
                    q_s, do_s, uq_s, k_ring.index(slot), v_ring.index(slot),
                    uk_ring.index(slot), uv_ring.index(slot), r_al, r_e, l2, m0,
                    i * BLOCK_N, scale, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
            else:
                qb, dob = _direct_tile(
                    q_s, do_s, uq_s, k_ring.index(slot), v_ring.index(slot),
                    uk_ring.index(slot), uv_ring.index(slot), qb, dob, l2, di, al, ee, m0,
                    i * BLOCK_N, scale, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, s_layout,
                    op_layout, LOW_REGS)
            if WS:  # its products are complete: the producer may refill the slot
                mbarrier.arrive(empty.index(slot), count=1)
        if WS and CAUSAL:
            # tiles past this partition's rows (causal, the first of two partitions): wait
            # until each has arrived (its slot's previous tile is then released by every
            # partition) and hand it back, so that the slot's count stays per tile
            for i in range(mine, n_tiles):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                mbarrier.arrive(empty.index(slot), count=1)
        if STATS:
            offs = row0 + m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            gl.store(ALPHA + offs, r_al)
            gl.store(EE + offs, r_e - r_al * gl.load(DELTA + offs))  # E + αD
        else:
            _direct_epilogue(qb, dob, q_s, do_s, qb_desc, dob_desc, row0 + m0, scale)

    @gluon.jit
    def _row_producer(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc, q_s, do_s,
                      uq_s, k_ring, v_ring, uk_ring, uv_ring, q_bar, ready, empty, row0,
                      krow0, m0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMERS: gl.constexpr):
        """Producer partition (one warp): the query-side copies of every consumer
        partition, then key tiles [0, n_tiles) into the ring (each loaded once for all
        the consumer partitions), each slot refilled once every consumer has released it."""
        _load_query_tiles(q_desc, do_desc, uq_desc, q_s, do_s, uq_s, q_bar, row0 + m0,
                          CONSUMERS)
        for i in range(n_tiles):
            slot = i % STAGES
            # a fresh barrier counts as having completed the phase before phase 0, so the
            # first pass over the ring does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            _load_key_tile(k_desc, v_desc, uk_desc, uv_desc, k_ring, v_ring, uk_ring, uv_ring,
                           ready.index(slot), slot, krow0 + i * BLOCK_N)

    @gluon.jit
    def _gluon_bob_row_kernel(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                              qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, N, GROUPS, scale,
                              qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                              STATS: gl.constexpr, STAGES: gl.constexpr, WS: gl.constexpr,
                              CONSUMERS: gl.constexpr, LOW_REGS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              num_warps: gl.constexpr):
        """Query tile ``program_id(0)`` of (batch·query head) ``program_id(1)``: Q̄, dŌ
        (direct) or α, E + αD (STATS). Tile descriptors view (B·H·N, d) tensors (H = H_q
        for the query side, H_kv for K, V, U_K, U_V; (batch·query head) j reads
        (batch·kv head) j // GROUPS); LSE2 (L·log2e), DELTA, ALPHA, EE are flat (B·H_q·N,)
        float32 pointers. WS adds the one-warp TMA producer. CONSUMERS = 2 (with WS) splits
        the query tile between two consumer partitions of ``num_warps`` warps each (the
        query-side and output descriptors have BLOCK_M / CONSUMERS rows), which share the
        ring of key tiles (each slot released by both) but not their schedule; LOW_REGS
        (two consumers): the direct pass's schedule with fewer registers."""
        row0 = gl.program_id(1) * N  # TMA coordinates are int32 (checked by the wrapper)
        krow0 = (gl.program_id(1) // GROUPS) * N
        m0 = row_tile(N, BLOCK_M, CAUSAL)
        n_tiles = key_tiles(m0, N, BLOCK_M, BLOCK_N, CAUSAL)
        SUB: gl.constexpr = BLOCK_M // CONSUMERS
        dtype: gl.constexpr = q_desc.dtype
        q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], q_desc.layout)
        do_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], do_desc.layout)
        uq_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], uq_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        uk_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], uk_desc.layout)
        uv_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], uv_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_row_consumer, (qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, q_s.index(0),
                                 do_s.index(0), uq_s.index(0), k_ring, v_ring, uk_ring,
                                 uv_ring, q_bar, ready, empty, row0, krow0, m0, n_tiles, N,
                                 scale, qk_scale2, SUB, BLOCK_N, HEAD_DIM, CAUSAL, STATS,
                                 STAGES, True, k_desc, v_desc, uk_desc, uv_desc, LOW_REGS,
                                 num_warps)),
                (_row_consumer, (qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, q_s.index(1),
                                 do_s.index(1), uq_s.index(1), k_ring, v_ring, uk_ring,
                                 uv_ring, q_bar, ready, empty, row0, krow0, m0 + SUB, n_tiles,
                                 N, scale, qk_scale2, SUB, BLOCK_N, HEAD_DIM, CAUSAL, STATS,
                                 STAGES, True, k_desc, v_desc, uk_desc, uv_desc, LOW_REGS,
                                 num_warps)),
                (_row_producer, (q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                                 q_s, do_s, uq_s, k_ring, v_ring, uk_ring, uv_ring, q_bar,
                                 ready, empty, row0, krow0, m0, n_tiles, BLOCK_N, STAGES,
                                 CONSUMERS)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        elif WS:
            gl.warp_specialize([
                (_row_consumer, (qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, q_s.index(0),
                                 do_s.index(0), uq_s.index(0), k_ring, v_ring, uk_ring,
                                 uv_ring, q_bar, ready, empty, row0, krow0, m0, n_tiles, N,
                                 scale, qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, STATS,
                                 STAGES, True, k_desc, v_desc, uk_desc, uv_desc, False,
                                 num_warps)),
                (_row_producer, (q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                                 q_s, do_s, uq_s, k_ring, v_ring, uk_ring, uv_ring, q_bar,
                                 ready, empty, row0, krow0, m0, n_tiles, BLOCK_N, STAGES,
                                 CONSUMERS)),
            ], [1], [PRODUCER_REGS])
        else:
            _load_query_tiles(q_desc, do_desc, uq_desc, q_s, do_s, uq_s, q_bar, row0 + m0,
                              CONSUMERS)
            _row_consumer(qb_desc, dob_desc, LSE2, DELTA, ALPHA, EE, q_s.index(0),
                          do_s.index(0), uq_s.index(0), k_ring, v_ring, uk_ring, uv_ring,
                          q_bar, ready, empty, row0, krow0, m0, n_tiles, N, scale, qk_scale2,
                          BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, STATS, STAGES, False, k_desc,
                          v_desc, uk_desc, uv_desc, False, num_warps)


def _prepare(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, scale, causal, stats, block_n,
             block_m, num_warps, stages, out=None, consumers=1):
    """Kernel arguments, meta-parameters and the outputs of one launch, no checks, any
    device (scripts/kernels/gluon_compile_sm90.py builds CPU ones). Direct: outputs (qb, dob), flat
    (B·H_q·N, d), written into ``out`` if given; ``alpha``, ``ee`` are read. Stats: outputs
    (alpha, ee), (B·H_q·N,) float32, written into ``alpha``, ``ee`` (allocated if None).
    ``num_warps``: all consumer warps (each of the ``consumers`` partitions gets
    num_warps / consumers and block_m / consumers query rows)."""
    b, h, n, d = q.shape
    rows = [flat(x) for x in (q, do, uq, k, v, uk, uv)]
    if stats:
        alpha = torch.empty(b * h * n, dtype=torch.float32, device=q.device) if alpha is None \
            else alpha
        ee = torch.empty_like(alpha) if ee is None else ee
        outs = (alpha.view(-1), ee.view(-1))
        tile_out = (rows[0], rows[1])  # not written
    else:
        if out is None:
            outs = (torch.empty_like(rows[0]), torch.empty_like(rows[1]))
        else:
            outs = tuple(x.view(b * h * n, d) for x in out)
        tile_out = outs
    sub = block_m // consumers
    tiles = tile_descriptors(rows[:3], sub, d, q.dtype)
    tiles += tile_descriptors(rows[3:], block_n, d, q.dtype)
    tiles += tile_descriptors(tile_out, sub, d, q.dtype)
    lse2 = lse_log2(lse)
    if stats:
        vecs = (lse2, delta.reshape(-1), *outs)
    else:
        vecs = (lse2, delta.reshape(-1), alpha.reshape(-1), ee.reshape(-1))
    args = (*tiles, *vecs, n, h // k.shape[1], scale, scale * LOG2E)
    # two consumer partitions have 240 registers per thread each (CONSUMER_REGS): enough
    # for the direct pass's usual schedule at d = 64 with 32-key steps only
    # (scripts/kernels/gluon_compile_sm90.py: no spills with LOW_REGS elsewhere)
    low_regs = consumers == 2 and block_n + d > 96
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, CAUSAL=bool(causal),
                STATS=bool(stats), STAGES=stages, CONSUMERS=consumers, LOW_REGS=low_regs,
                num_warps=num_warps // consumers)
    return args, meta, outs


def launch_bob_row(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, *, stats, scale, causal,
                   block_n, block_m, num_warps, stages, warp_specialize=False, consumers=1,
                   maxnreg=None, out=None):
    """Launch the statistics pass (``stats``: writes α, E + αD into ``alpha``, ``ee``) or
    the direct pass (reads them, writes Q̄, dŌ into ``out``) without checks (the plan or
    the public entry point has verified the call). ``consumers=2`` (with the producer
    partition, which it implies, and num_warps = 8): two consumer partitions of 4 warps and
    block_m / 2 query rows each, sharing the ring of key tiles."""
    b, h, n, d = q.shape
    args, meta, outs = _prepare(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, scale, causal,
                                stats, block_n, block_m, num_warps, stages, out, consumers)
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    _gluon_bob_row_kernel[(n // block_m, b * h)](
        *args, WS=bool(warp_specialize) or consumers > 1, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, **meta)
    return outs


def _check(fn, q, k, v, do, uq, uk, uv, vecs, out, block_n, block_m, num_warps, stages,
           warp_specialize, consumers):
    tiles = [(name, x, name in ("k", "v", "uk", "uv")) for name, x in
             (("k", k), ("v", v), ("do", do), ("uq", uq), ("uk", uk), ("uv", uv))]
    shape = check_args(fn, q, k, tiles, vecs, out, block_n=block_n, block_m=block_m,
                       num_warps=num_warps, per_warp="block_m", stages=stages,
                       available=available(q.device))
    if consumers not in (1, 2) or (consumers == 2 and not (warp_specialize and num_warps == 8)):
        raise ValueError(f"{fn}: consumers must be 1, or 2 with warp_specialize=True and "
                         f"num_warps=8, got consumers={consumers!r}, "
                         f"warp_specialize={warp_specialize}, num_warps={num_warps}")
    return shape


def gluon_bob_direct(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, *, scale=None,
                     causal=False, block_n=BLOCK_N, block_m=BLOCK_M, num_warps=NUM_WARPS,
                     stages=STAGES, warp_specialize=False, consumers=1, maxnreg=None, out=None):
    """Q̄, dŌ of the BoB (bob-math.md) for every query tile: the Triton direct pass's results.

    q, do, uq: (B, H_q, N, d) and k, v, uk, uv: (B, H_kv, N, d), bf16/fp16 on one sm_90
    device (all three cotangents present; H_q a multiple of H_kv); lse (natural log, as
    ``attn_fwd`` returns it), delta = rowsum(dO∘O), alpha and ee = E + αD (the statistics
    pass's outputs): (B, H_q, N) float32, contiguous. Returns (qb, dob), each
    (B, H_q, N, d) in q's dtype. Tile inputs that are not contiguous
    are copied.

    ``block_m`` queries per program (16 per warp: block_m == 16·num_warps, num_warps 4 or
    8), ``block_n`` keys per step, ``stages`` ring slots (2 to 4), ``warp_specialize`` adds
    a one-warp TMA producer partition, ``consumers=2`` (with ``warp_specialize`` and 8
    warps) splits the query tile between two 4-warp consumer partitions of block_m / 2 rows
    that share the ring of key tiles (each tile loaded once per program), ``maxnreg`` caps
    ptxas's registers per thread.
    ``out``: optional (qb, dob) pair of contiguous tensors like q to write into.
    """
    fn = "gluon_bob_direct"
    vecs = (("lse", lse), ("delta", delta), ("alpha", alpha), ("ee", ee))
    b, h, n, d = _check(fn, q, k, v, do, uq, uk, uv, vecs,
                        None if out is None else (("out[0]", out[0], False),
                                                  ("out[1]", out[1], False)),
                        block_n, block_m, num_warps, stages, warp_specialize, consumers)
    scale = d ** -0.5 if scale is None else float(scale)
    qb, dob = launch_bob_row(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, stats=False,
                             scale=scale, causal=causal, block_n=block_n, block_m=block_m,
                             num_warps=num_warps, stages=stages,
                             warp_specialize=warp_specialize, consumers=consumers,
                             maxnreg=maxnreg, out=out)
    return qb.view(b, h, n, d), dob.view(b, h, n, d)


def gluon_bob_stats(q, k, v, do, uq, uk, uv, lse, delta, *, scale=None, causal=False,
                    block_n=BLOCK_N, block_m=BLOCK_M, num_warps=NUM_WARPS, stages=STAGES,
                    warp_specialize=False, consumers=1, maxnreg=None, out=None):
    """α and E + αD of the BoB (bob-math.md) for every query row: the Triton statistics
    pass's results without the ρ row-sum correction (16-bit inputs do not use it).

    Inputs and tile options (``consumers`` included) as :func:`gluon_bob_direct` (without
    alpha, ee). Returns (alpha, ee), each
    (B, H, N) float32. ``out``: optional (alpha, ee) pair of contiguous (B, H, N) float32
    tensors to write into.
    """
    fn = "gluon_bob_stats"
    vecs = (("lse", lse), ("delta", delta))
    b, h, n, d = _check(fn, q, k, v, do, uq, uk, uv, vecs, None, block_n, block_m, num_warps,
                        stages, warp_specialize, consumers)
    if out is None:
        out = tuple(torch.empty(b, h, n, dtype=torch.float32, device=q.device)
                    for _ in range(2))
    for name, x in zip(("out[0]", "out[1]"), out):
        if x.shape != (b, h, n) or x.dtype != torch.float32 or x.device != q.device or \
                not x.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous float32 of shape {(b, h, n)} "
                             f"on {q.device}")
    scale = d ** -0.5 if scale is None else float(scale)
    launch_bob_row(q, k, v, do, uq, uk, uv, lse, delta, out[0], out[1], stats=True,
                   scale=scale, causal=causal, block_n=block_n, block_m=block_m,
                   num_warps=num_warps, stages=stages, warp_specialize=warp_specialize,
                   consumers=consumers, maxnreg=maxnreg)
    return out
