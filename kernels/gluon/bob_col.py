"""BoB column pass in Gluon (TMA + async wgmma, optional warp specialisation), sm_90.

``attn_bob`` launches it instead of the Triton ``_bob_col_kernel`` (bob_col.py) where the
plan (plan.py, with :func:`..scope.bob_col_reason`) finds the call in its scope, with the
tiles of ``configs.GLUON``; everywhere else the Triton pass runs. Same inputs and outputs as
the Triton column pass: from Q, K, V, dO, the cotangents U_Q, U_K, U_V, the forward's L,
D = rowsum(dO∘O) and the statistics pass's α and E + αD (and ρ where the row-sum correction
is on), it writes K̄ and V̄ of every key tile (bob-math.md). It matches float64 double
backward as closely as the Triton column pass (tests/test_gluon_gpu.py); its timings are in
docs/benchmarks.md.

One program owns one key tile (BLOCK_N keys of one (batch, kv head)): K, V, U_K, U_V come to
shared memory once by TMA; the query tiles that can see the keys, of every query head that
reads this kv head (GQA: H_q / H_kv of them, one sweep after the other), stream through a
ring of ``stages`` slots of (Q, dO, U_Q) tiles, one mbarrier per slot. Per query tile, in
(keys x queries) orientation, with τ = ``scale``, per-query vectors broadcast along keys:

    Sᵀ = K Qᵀ                 Pᵀ = exp2(τ·log2e·Sᵀ − L·log2e)  (·ρ)
    Gᵀ = τ (U_K Qᵀ + K U_Qᵀ) − α                 Hᵀ = Pᵀ∘Gᵀ
    dPᵀ = V dOᵀ,  Bᵀ = U_V dOᵀ                   dSᵀ = Pᵀ∘(dPᵀ − D)
    Rᵀ = Gᵀ∘dSᵀ + Pᵀ∘(Bᵀ − (E + αD))
    V̄ += Hᵀ dO,   K̄ += Rᵀ Q + dSᵀ U_Q            (K̄ scaled by τ at the end)

Eight ``warpgroup_mma`` per tile pair: the five score-shaped products are issued together
asynchronously; Sᵀ and Gᵀ are waited for first, so Pᵀ and Hᵀ are formed while dPᵀ and Bᵀ are
still on the tensor cores, and V̄ += Hᵀ dO is issued before dPᵀ, Bᵀ are waited for. Hᵀ, Rᵀ
and dSᵀ enter as register A operands.

Three program shapes:

- single partition (``warp_specialize=False``): every warp issues the TMA copies itself
  (the next ``stages - 1`` tiles are in flight while one is consumed);
- warp-specialised (``warp_specialize=True``): a one-warp producer partition (few registers)
  issues the K/V/U_K/U_V copy and the ring's copies, waiting on per-slot "empty" barriers;
  the ``num_warps`` consumer warps (the default partition) wait on per-slot "ready" barriers,
  do the products and release each slot once its products are done (FlashAttention-3's
  producer/consumer structure, in Gluon's ``warp_specialize``). With ``defer`` a tile's K̄
  products are retired by the next tile's first wait instead of its own last one;
- two consumer partitions (``consumers=2``, warp-specialised, 8 warps): the program owns
  ``block_n`` keys, each of two 4-warp consumer partitions owns ``block_n / 2`` of them
  (its own K, V, U_K, U_V, K̄, V̄) and both read the one ring of query tiles that the
  producer fills, so each query tile is loaded once for both (a slot's "empty" barrier
  counts one release per partition); the partitions keep no common schedule. Under causal
  masking the ring holds the query tiles that see the program's first key; the second
  partition's products over the first ones are zero.

Scope: scope.py (``bob_col_reason``); :func:`gluon_bob_col` checks its arguments (a
ValueError naming the argument), :func:`launch_bob_col` does not. Not covered: varlen,
window, missing cotangents, ``precise=False``'s affine row pass, float32.

Triton versions: Gluon's API moves. triton 3.6 names the TMA copies
``async_copy_global_to_shared`` / ``async_copy_shared_to_global``, later versions
``async_load`` / ``async_store`` (common.py looks up both); ``gl.warp_specialize`` takes
``[(default_fn, args), (worker_fn, args), ...], worker_num_warps, worker_num_regs`` in 3.6
and 3.9 (3.9 makes the register list optional; earlier releases took the default and worker
partitions as separate arguments, which this module does not support).
"""

from __future__ import annotations

import torch

from . import common as _gc
from .common import *  # noqa: F401,F403 - the pass header: Gluon's names for the kernels, LOG2E
from .common import (CONSUMER_REGS, PRODUCER_REGS, check_args, flat, lse_log2,
                     tile_descriptors)

#: Gluon's Hopper ops and its list-form ``warp_specialize`` import (common.py)
HAVE_GLUON = _gc.HAVE_PASSES

BLOCK_N = 64
BLOCK_M = 64
NUM_WARPS = 4
STAGES = 2

available = _gc.available


if HAVE_GLUON:

    @gluon.jit
    def _load_key_tiles(k_desc, v_desc, uk_desc, uv_desc, k_smem, v_smem, uk_smem, uv_smem,
                        bar, row, CONSUMERS: gl.constexpr):
        """K, V, U_K, U_V rows [row, row + CONSUMERS·BLOCK_N) to shared memory (the key tile
        of consumer partition c, rows from row + c·BLOCK_N, in buffer index c), completing on
        ``bar``."""
        sub: gl.constexpr = k_desc.block_type.shape[0]
        mbarrier.expect(bar, 4 * CONSUMERS * k_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            _tma_load(k_desc, [row + c * sub, 0], bar, k_smem.index(c))
            _tma_load(v_desc, [row + c * sub, 0], bar, v_smem.index(c))
            _tma_load(uk_desc, [row + c * sub, 0], bar, uk_smem.index(c))
            _tma_load(uv_desc, [row + c * sub, 0], bar, uv_smem.index(c))

    @gluon.jit
    def _load_query_tile(q_desc, do_desc, uq_desc, r_desc, q_ring, do_ring, uq_ring, vecs,
                         bar, slot, row):
        """Q, dO, U_Q rows [row, row + BLOCK_M) and their packed row vectors (L·log2e, D, α,
        E + αD, ρ) into ring slot ``slot``, completing on ``bar``."""
        mbarrier.expect(bar, 3 * q_desc.block_type.nbytes + r_desc.block_type.nbytes)
        _tma_load(q_desc, [row, 0], bar, q_ring.index(slot))
        _tma_load(do_desc, [row, 0], bar, do_ring.index(slot))
        _tma_load(uq_desc, [row, 0], bar, uq_ring.index(slot))
        _tma_load(r_desc, [0, row], bar, vecs.index(slot))

    @gluon.jit
    def _col_buffers(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc, r_desc,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     NVEC: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """The shared memory of a column program: the key-side tiles (one set per consumer
        partition: [CONSUMERS, BLOCK_N, HEAD_DIM] each), the rings of query tiles and packed
        row vectors (shared by the consumer partitions), the key-side barrier and the ring's
        "ready" barriers (initialised)."""
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], v_desc.layout)
        uk_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM],
                                            uk_desc.layout)
        uv_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM],
                                            uv_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        uq_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], uq_desc.layout)
        vecs = gl.allocate_shared_memory(gl.float32, [STAGES, NVEC, BLOCK_M], r_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        return k_smem, v_smem, uk_smem, uv_smem, q_ring, do_ring, uq_ring, vecs, kv_bar, ready

    @gluon.jit
    def _query_vec(vecs, i: gl.constexpr, layout: gl.constexpr):
        """Row vector ``i`` of a ring slot's packed vectors, broadcast along the keys of a
        (keys x queries) tile (read from shared memory where it is used: held in registers
        it would cost BLOCK_M / 4 per thread for the whole tile)."""
        return vecs.slice(i, 1, dim=0).load(layout)  # [1, BLOCK_M]

    @gluon.jit
    def _col_tile(k_smem, v_smem, uk_smem, uv_smem, q_s, do_s, uq_s, vecs, kb, vb,
                  r_prev, ds_prev, m0, n0, scale, qk_scale2, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, NVEC: gl.constexpr,
                  DEFER: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr):
        """(K̄, V̄, Rᵀ, dSᵀ) after query tile [m0, m0 + BLOCK_M) (its Q, dO, U_Q tiles in
        shared memory ``q_s``, ``do_s``, ``uq_s``, its row vectors in ``vecs``).

        Without DEFER every product is complete on return. With DEFER the two K̄ products
        are left running: ``kb`` comes in and goes out as a pending accumulator, and the
        previous tile's K̄ operands ``r_prev``, ``ds_prev`` are retired by this tile's first
        wait (so the previous tile's K̄ products overlap this tile's score products); the
        caller then releases the previous tile's ring slot and waits for the last one."""
        dtype: gl.constexpr = q_s.dtype
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        qt = q_s.permute((1, 0))
        st = warpgroup_mma(k_smem, qt, s_zero, use_acc=False, is_async=True)
        gt = warpgroup_mma(uk_smem, qt, s_zero, use_acc=False, is_async=True)
        gt = warpgroup_mma(k_smem, uq_s.permute((1, 0)), gt, is_async=True)
        bt = warpgroup_mma(uv_smem, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if DEFER:  # also retires the previous tile's K̄ products
            st, gt, kb, r_prev, ds_prev = warpgroup_mma_wait(
                num_outstanding=1, deps=(st, gt, kb, r_prev, ds_prev))  # Bᵀ in flight
        else:
            st, gt = warpgroup_mma_wait(num_outstanding=1, deps=(st, gt))  # Bᵀ in flight

        pt = gl.exp2(st * qk_scale2 - _query_vec(vecs, 0, s_layout))
        if CAUSAL:
            if m0 < n0 + BLOCK_N:  # only the diagonal tiles hold masked pairs
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
                vis = gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1)
                pt = gl.where(vis, pt, 0.0)
        if NVEC == 8:
            pt = pt * _query_vec(vecs, 4, s_layout)  # P·ρ
        gt = gt * scale - _query_vec(vecs, 2, s_layout)  # Gᵀ − α
        h_op = gl.convert_layout((pt * gt).to(dtype), op_layout)
        vb = warpgroup_mma(h_op, do_s, vb, is_async=True)
        dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        bt = warpgroup_mma_wait(num_outstanding=2, deps=(bt,))  # V̄, dPᵀ in flight
        tt = pt * (bt - _query_vec(vecs, 3, s_layout))  # Pᵀ∘(Bᵀ − (E + αD))
        vb, dpt, h_op = warpgroup_mma_wait(num_outstanding=0, deps=(vb, dpt, h_op))

        dst = pt * (dpt - _query_vec(vecs, 1, s_layout))  # dSᵀ
        r_op = gl.convert_layout((gt * dst + tt).to(dtype), op_layout)
        ds_op = gl.convert_layout(dst.to(dtype), op_layout)
        kb = warpgroup_mma(r_op, q_s, kb, is_async=True)
        kb = warpgroup_mma(ds_op, uq_s, kb, is_async=True)
        if not DEFER:
            kb, r_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(kb, r_op, ds_op))
        return kb, vb, r_op, ds_op

    @gluon.jit
    def _col_epilogue(kb, vb, k_smem, v_smem, kb_desc, vb_desc, row, scale):
        """K̄·τ and V̄ to HBM by TMA, staged through the (no longer read) K and V buffers."""
        dtype: gl.constexpr = k_smem.dtype
        k_smem.store((kb * scale).to(dtype))
        v_smem.store(vb.to(dtype))
        fence_async_shared()
        _tma_store(kb_desc, [row, 0], k_smem)
        _tma_store(vb_desc, [row, 0], v_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gluon_bob_col_kernel(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                              kb_desc, vb_desc, r_desc, N,
                              scale, qk_scale2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                              NVEC: gl.constexpr, STAGES: gl.constexpr, GROUPS: gl.constexpr,
                              CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
        """Single partition: K̄, V̄ of key tile ``program_id(0)`` of (batch·kv head)
        ``program_id(1)``, summed over its GROUPS query heads. Tile descriptors view
        (B·H·N, d) tensors (H = H_q for Q, dO, U_Q; H_kv for the key side), the row-vector
        descriptor the packed (NVEC, B·H_q·N) float32 rows (L·log2e, D, α, E + αD, ρ)."""
        n0 = gl.program_id(0) * BLOCK_N
        row0 = gl.program_id(1) * N  # TMA coordinates are int32 (checked by the wrapper)
        qrow0 = row0 * GROUPS  # first query row of the group
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)

        (k_all, v_all, uk_all, uv_all, q_ring, do_ring, uq_ring, vecs, kv_bar,
         ready) = _col_buffers(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                               r_desc, BLOCK_M, BLOCK_N, HEAD_DIM, NVEC, STAGES, 1)
        k_smem = k_all.index(0)
        v_smem = v_all.index(0)
        uk_smem = uk_all.index(0)
        uv_smem = uv_all.index(0)

        _load_key_tiles(k_desc, v_desc, uk_desc, uv_desc, k_all, v_all, uk_all, uv_all,
                        kv_bar, row0 + n0, 1)
        lo, n_tiles = query_range(n0, N, BLOCK_M, CAUSAL)
        total = GROUPS * n_tiles
        for s in gl.static_range(STAGES - 1):  # fill all slots but one
            if s < total:
                qrow, _ = query_row(qrow0, s, lo, n_tiles, N, BLOCK_M, GROUPS)
                _load_query_tile(q_desc, do_desc, uq_desc, r_desc, q_ring, do_ring, uq_ring,
                                 vecs, ready.index(s), s, qrow)

        kb = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        vb = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        for i in range(total):
            # refill the slot consumed (and waited for) in the previous iteration
            nxt = i + STAGES - 1
            if nxt < total:
                ns = nxt % STAGES
                nrow, _ = query_row(qrow0, nxt, lo, n_tiles, N, BLOCK_M, GROUPS)
                _load_query_tile(q_desc, do_desc, uq_desc, r_desc, q_ring, do_ring, uq_ring,
                                 vecs, ready.index(ns), ns, nrow)
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            kb, vb, _, _ = _col_tile(k_smem, v_smem, uk_smem, uv_smem, q_ring.index(slot),
                                     do_ring.index(slot), uq_ring.index(slot),
                                     vecs.index(slot), kb, vb, None, None,
                                     query_pos(i, lo, n_tiles, BLOCK_M, GROUPS), n0, scale,
                                     qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, NVEC, False,
                                     s_layout, op_layout)

        mbarrier.invalidate(kv_bar)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        _col_epilogue(kb, vb, k_smem, v_smem, kb_desc, vb_desc, row0 + n0, scale)

    # ----------------------------------------------------------------- warp-specialised

    @gluon.jit
    def _ws_producer(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc, r_desc,
                     k_smem, v_smem, uk_smem, uv_smem, q_ring,
                     do_ring, uq_ring, vecs, kv_bar, ready, empty, row0, n0, N,
                     GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """Producer partition (one warp): the key-side copy (every consumer partition's key
        tile, from key ``n0``), then the query tiles that see any of these keys into the
        ring, each slot refilled once every consumer partition has released it."""
        _load_key_tiles(k_desc, v_desc, uk_desc, uv_desc, k_smem, v_smem, uk_smem, uv_smem,
                        kv_bar, row0 + n0, CONSUMERS)
        lo, n_tiles = query_range(n0, N, BLOCK_M, CAUSAL)
        for i in range(GROUPS * n_tiles):
            slot = i % STAGES
            # a fresh barrier counts as having completed the phase before phase 0, so the
            # first pass over the ring does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            qrow, _ = query_row(row0 * GROUPS, i, lo, n_tiles, N, BLOCK_M, GROUPS)
            _load_query_tile(q_desc, do_desc, uq_desc, r_desc, q_ring, do_ring, uq_ring, vecs,
                             ready.index(slot), slot, qrow)

    @gluon.jit
    def _ws_consumer(kb_desc, vb_desc, k_smem, v_smem, uk_smem, uv_smem, q_ring, do_ring,
                     uq_ring, vecs, kv_bar, ready, empty, row0, nq0, n0, N,
                     GROUPS: gl.constexpr, scale, qk_scale2, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                     NVEC: gl.constexpr, STAGES: gl.constexpr, DEFER: gl.constexpr,
                     num_warps: gl.constexpr):
        """Consumer partition (``num_warps`` warps) owning key tile [n0, n0 + BLOCK_N) (its
        K, V, U_K, U_V in ``k_smem`` ..): the products of every query tile of the ring (the
        query tiles that see the program's keys from ``nq0``; under causal masking the
        first ones may see none of this partition's keys, their products are zero), each
        slot released once its products are done, then the epilogue."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        lo, n_tiles = query_range(nq0, N, BLOCK_M, CAUSAL)
        total = GROUPS * n_tiles  # the query tiles of every head of the group
        kb = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        vb = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        if DEFER:
            kb = warpgroup_mma_init(kb)  # carried as a pending accumulator
            r_op = gl.zeros([BLOCK_N, BLOCK_M], q_ring.dtype, op_layout)
            ds_op = gl.zeros([BLOCK_N, BLOCK_M], q_ring.dtype, op_layout)
            for i in range(total):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                kb, vb, r_op, ds_op = _col_tile(
                    k_smem, v_smem, uk_smem, uv_smem, q_ring.index(slot), do_ring.index(slot),
                    uq_ring.index(slot), vecs.index(slot), kb, vb, r_op, ds_op,
                    query_pos(i, lo, n_tiles, BLOCK_M, GROUPS), n0, scale, qk_scale2, BLOCK_M,
                    BLOCK_N, CAUSAL, NVEC, True, s_layout, op_layout)
                # the previous tile's products are complete (retired inside _col_tile)
                fence_async_shared()
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
            kb, r_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(kb, r_op, ds_op))
        else:
            for i in range(total):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                kb, vb, _, _ = _col_tile(
                    k_smem, v_smem, uk_smem, uv_smem, q_ring.index(slot), do_ring.index(slot),
                    uq_ring.index(slot), vecs.index(slot), kb, vb, None, None,
                    query_pos(i, lo, n_tiles, BLOCK_M, GROUPS), n0, scale, qk_scale2, BLOCK_M,
                    BLOCK_N, CAUSAL, NVEC, False, s_layout, op_layout)
                # its products are complete; order this partition's reads of the row vectors
                # (generic proxy) before the producer's next TMA write of the slot (async)
                fence_async_shared()
                mbarrier.arrive(empty.index(slot), count=1)
        _col_epilogue(kb, vb, k_smem, v_smem, kb_desc, vb_desc, row0 + n0, scale)

    @gluon.jit
    def _gluon_bob_col_ws_kernel(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                                 kb_desc, vb_desc, r_desc, N,
                                 scale, qk_scale2, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                                 CAUSAL: gl.constexpr, NVEC: gl.constexpr,
                                 STAGES: gl.constexpr, GROUPS: gl.constexpr,
                                 CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr,
                                 DEFER: gl.constexpr, num_warps: gl.constexpr):
        """Warp-specialised: as ``_gluon_bob_col_kernel``, with a one-warp TMA producer
        partition and CONSUMERS consumer partitions of ``num_warps`` warps each. The program
        owns keys [CONSUMERS·BLOCK_N·program_id(0), + CONSUMERS·BLOCK_N); consumer c owns
        the key tile BLOCK_N·c of them. The producer loads each query tile once into the
        ring, which all consumer partitions read (a slot's "empty" barrier counts one
        release per consumer)."""
        nq0 = gl.program_id(0) * (CONSUMERS * BLOCK_N)
        row0 = gl.program_id(1) * N
        (k_smem, v_smem, uk_smem, uv_smem, q_ring, do_ring, uq_ring, vecs, kv_bar,
         ready) = _col_buffers(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                               r_desc, BLOCK_M, BLOCK_N, HEAD_DIM, NVEC, STAGES, CONSUMERS)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty.index(s), count=CONSUMERS)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_ws_consumer, (kb_desc, vb_desc, k_smem.index(0), v_smem.index(0),
                                uk_smem.index(0), uv_smem.index(0), q_ring, do_ring, uq_ring,
                                vecs, kv_bar, ready, empty, row0, nq0, nq0, N, GROUPS, scale,
                                qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, NVEC, STAGES,
                                DEFER, num_warps)),
                (_ws_consumer, (kb_desc, vb_desc, k_smem.index(1), v_smem.index(1),
                                uk_smem.index(1), uv_smem.index(1), q_ring, do_ring, uq_ring,
                                vecs, kv_bar, ready, empty, row0, nq0, nq0 + BLOCK_N, N,
                                GROUPS, scale, qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL,
                                NVEC, STAGES, DEFER, num_warps)),
                (_ws_producer, (q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                                r_desc, k_smem, v_smem, uk_smem, uv_smem, q_ring, do_ring,
                                uq_ring, vecs, kv_bar, ready, empty, row0, nq0, N, GROUPS,
                                BLOCK_M, CAUSAL, STAGES, CONSUMERS)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (kb_desc, vb_desc, k_smem.index(0), v_smem.index(0),
                                uk_smem.index(0), uv_smem.index(0), q_ring, do_ring, uq_ring,
                                vecs, kv_bar, ready, empty, row0, nq0, nq0, N, GROUPS, scale,
                                qk_scale2, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, NVEC, STAGES,
                                DEFER, num_warps)),
                (_ws_producer, (q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc,
                                r_desc, k_smem, v_smem, uk_smem, uv_smem, q_ring, do_ring,
                                uq_ring, vecs, kv_bar, ready, empty, row0, nq0, N, GROUPS,
                                BLOCK_M, CAUSAL, STAGES, CONSUMERS)),
            ], [1], [PRODUCER_REGS])


def _prepare(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho, scale, causal, block_n,
             block_m, num_warps, stages, out=None, consumers=1):
    """Kernel arguments, meta-parameters and the (kb, vb) outputs (flat (B·H_kv·N, d);
    ``out``: contiguous (kb, vb) to write into) of one launch; no checks, any device
    (scripts/kernels/gluon_compile_sm90.py builds CPU ones). ``block_n`` / ``num_warps``: the keys /
    consumer warps of a program (each of the ``consumers`` partitions gets
    block_n / consumers keys and num_warps / consumers warps)."""
    b, h, n, d = q.shape
    hk = k.shape[1]
    rows_q = [flat(x) for x in (q, do, uq)]
    rows_k = [flat(x) for x in (k, v, uk, uv)]
    if out is None:
        kb, vb = torch.empty_like(rows_k[0]), torch.empty_like(rows_k[1])
    else:
        kb, vb = (x.view(b * hk * n, d) for x in out)
    tiles = tile_descriptors(rows_q, block_m, d, q.dtype)
    tiles += tile_descriptors((*rows_k, kb, vb), block_n // consumers, d, q.dtype)
    rows = [lse_log2(lse)] + [x.reshape(-1) for x in (delta, alpha, ee)]
    if rho is not None:  # 8 rows (power of two): ρ and three unread copies
        rows += [rho.reshape(-1)] * 4
    rows = torch.stack(rows)  # (NVEC, B·H·N): one TMA copy per query tile
    nvec = rows.shape[0]
    lay_r = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    vecs = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [nvec, block_m], lay_r)
    args = (*tiles, vecs, n, scale, scale * LOG2E)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n // consumers, HEAD_DIM=d,
                CAUSAL=bool(causal), NVEC=nvec, STAGES=stages, GROUPS=h // hk,
                CONSUMERS=consumers, num_warps=num_warps // consumers)
    return args, meta, (kb, vb)


def launch_bob_col(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho=None, *, scale,
                   causal, block_n, block_m, num_warps, stages, warp_specialize=False,
                   defer=False, consumers=1, maxnreg=None, out=None):
    """Launch the pass without checks (the plan or :func:`gluon_bob_col` has verified the
    call); returns (kb, vb), (B, H_kv, N, d). ``consumers=2`` (warp-specialised only):
    two consumer partitions of num_warps / 2 warps, each owning block_n / 2 keys."""
    b, h, n, d = q.shape
    hk = k.shape[1]
    args, meta, (kb, vb) = _prepare(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho, scale,
                                    causal, block_n, block_m, num_warps, stages, out=out,
                                    consumers=consumers)
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    grid = (n // block_n, b * hk)
    if warp_specialize or consumers > 1:
        _gluon_bob_col_ws_kernel[grid](*args, CONSUMER_REGS=CONSUMER_REGS,
                                       PRODUCER_REGS=PRODUCER_REGS, DEFER=bool(defer), **meta)
    else:
        _gluon_bob_col_kernel[grid](*args, **meta)
    return kb.view(b, hk, n, d), vb.view(b, hk, n, d)


def gluon_bob_col(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho=None, *, scale=None,
                  causal=False, block_n=BLOCK_N, block_m=BLOCK_M, num_warps=NUM_WARPS,
                  stages=STAGES, warp_specialize=False, defer=False, consumers=1,
                  maxnreg=None, out=None):
    """K̄, V̄ of the BoB (bob-math.md) for every key tile: the Triton column pass's results.

    q, do, uq: (B, H_q, N, d) and k, v, uk, uv: (B, H_kv, N, d), bf16/fp16 on one sm_90
    device (all three cotangents present; H_q a multiple of H_kv, query head h reading kv
    head h // (H_q / H_kv)); lse (natural log, as ``attn_fwd`` returns it),
    delta = rowsum(dO∘O), alpha, ee = E + αD (the statistics pass's outputs) and optional rho
    (row-sum correction, None: off, as for 16-bit inputs in the library): (B, H_q, N)
    float32. Returns (kb, vb), each (B, H_kv, N, d) in q's dtype, summed over the query
    heads of each kv head. Inputs that are not contiguous are copied.

    ``block_n`` keys per program (16 per warp: block_n == 16·num_warps, num_warps 4 or 8),
    ``block_m`` queries per step (dividing block_n), ``stages`` ring slots (2 to 4),
    ``warp_specialize`` adds a one-warp TMA producer partition; ``defer`` (warp-specialised
    only) leaves each tile's K̄ products running into the next tile, so a slot is released
    one tile later (use 3 slots or more); ``consumers=2`` (with ``warp_specialize`` and
    8 warps) splits the key tile between two 4-warp consumer partitions (block_n / 2 keys
    each) that share the ring of query tiles, so each query tile is loaded once for both;
    ``maxnreg`` caps ptxas's
    registers per thread (None: no cap; with ``warp_specialize`` it sets the budget the
    partitions' registers are carved from). ``out``: optional (kb, vb) pair of contiguous
    tensors like k to write into.
    """
    fn = "gluon_bob_col"
    b, h, n, d = check_args(
        fn, q, k, [(name, x, name in ("k", "v", "uk", "uv")) for name, x in
                   (("k", k), ("v", v), ("do", do), ("uq", uq), ("uk", uk), ("uv", uv))],
        (("lse", lse), ("delta", delta), ("alpha", alpha), ("ee", ee), ("rho?", rho)),
        None if out is None else (("out[0]", out[0], True), ("out[1]", out[1], True)),
        block_n=block_n, block_m=block_m, num_warps=num_warps, per_warp="block_n",
        stages=stages, available=available(q.device))
    if defer and not warp_specialize:
        raise ValueError(f"{fn}: defer=True needs warp_specialize=True")
    if consumers not in (1, 2) or (consumers == 2 and not (warp_specialize and num_warps == 8
                                                           and (block_n // 2) % block_m == 0)):
        raise ValueError(f"{fn}: consumers must be 1, or 2 with warp_specialize=True, "
                         f"num_warps=8 and block_m dividing block_n / 2, got "
                         f"consumers={consumers!r}, warp_specialize={warp_specialize}, "
                         f"num_warps={num_warps}, block_n={block_n}, block_m={block_m}")
    scale = d ** -0.5 if scale is None else float(scale)
    return launch_bob_col(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho, scale=scale,
                          causal=causal, block_n=block_n, block_m=block_m,
                          num_warps=num_warps, stages=stages, warp_specialize=warp_specialize,
                          defer=defer, consumers=consumers, maxnreg=maxnreg, out=out)
