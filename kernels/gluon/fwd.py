"""Forward pass in Gluon (TMA key-tile ring + async wgmma, optional warp specialisation),
sm_90: O = softmax(τ Q Kᵀ) V and the row log-sum-exp L.

``attn_fwd`` launches it instead of the Triton ``_attn_fwd_kernel`` (fwd.py) where the
plan (plan.py, with :func:`..scope.fwd_reason`) finds the call in its scope, with the tiles
of ``configs.GLUON``; everywhere else the Triton forward runs. Its outputs have the Triton
forward's format and layout, so every backward pass reads them unchanged: O contiguous
(B, H_q, N, d) in the input dtype, L float32 (B, H_q, N) in natural-log units
(tests/test_gluon_gpu.py compares both with the Triton forward and float64).

One program owns one query tile (BLOCK_M queries of one (batch, query head)): Q comes to
shared memory once by TMA, the key tiles that the queries see stream through a ring of
``stages`` slots of (K, V) tiles, one mbarrier per tile per slot (K and V complete and are
released separately: Q Kᵀ can start before V has arrived, and a K slot is refilled a softmax
before its V slot). Online softmax in log2 units, with c = τ·log2e and per-query vectors
broadcast along the keys:

    S_j = Q K_jᵀ      m ← max(m, c·rowmax(S_j))      P_j = exp2(c·S_j − m)
    ℓ ← ℓ·exp2(m_old − m) + rowsum(P_j)          O ← O·exp2(m_old − m) + P_j V_j
    at the end: O / ℓ and L = (m + log2 ℓ)·ln 2

Schedule of a consumer: the product S_{j+1} = Q K_{j+1}ᵀ is issued asynchronously before
P_j V_j, so the softmax of tile j + 1 runs on the CUDA cores while P_j V_j is on the tensor
cores; O is rescaled once that product is complete. P enters as a register A operand.

Program shapes (``warp_specialize``, ``consumers``, ``pingpong``):

- single partition (``warp_specialize=False``): the warps issue the TMA copies themselves
  (every ring slot filled ahead; a K slot refilled as soon as its S is complete, a V slot
  once its P V is);
- warp-specialised (``warp_specialize=True``): a one-warp producer partition issues the Q
  copy and the rings' copies (K one tile ahead of V), waiting on per-slot "free" barriers
  that the consumer warps release at the same points. The compiler keeps the warps of one
  partition in step (its barriers span the partition);
- two consumer partitions (``consumers=2``, with the producer): each of num_warps / 2 warps
  owns half the query tile and runs its own schedule over the shared K / V ring (a slot is
  free once both have released it); with ``pingpong`` they take turns to issue their
  products (one mbarrier each), so that one's softmax overlaps the other's products.

Causal: the query tiles are taken longest row first (program 0 gets the last query tile);
only the key tiles that reach past the tile's first query are masked. A row that sees no key
(not possible in this pass's scope, N_q == N_k without a window) would get O = 0 and
L = −inf, as in the Triton forward.

Scope: scope.py (``fwd_reason``); :func:`gluon_attn_fwd` checks its arguments (a ValueError
naming the argument), :func:`launch_fwd` does not. GQA / MQA: query head h reads kv head
h // (H_q / H_kv). Not covered: varlen, window, N_q ≠ N_k, float32 (the Triton forward).
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
    def _load_k(k_desc, k_ring, bar, slot, row):
        """K rows [row, row + BLOCK_N) into ring slot ``slot``, completing on ``bar``."""
        mbarrier.expect(bar, k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, 0], bar, k_ring.index(slot))

    @gluon.jit
    def _load_v(v_desc, v_ring, bar, slot, row):
        """V rows [row, row + BLOCK_N) into ring slot ``slot``, completing on ``bar``."""
        mbarrier.expect(bar, v_desc.block_type.nbytes)
        _tma_load(v_desc, [row, 0], bar, v_ring.index(slot))

    @gluon.jit
    def _load_q(q_desc, q_s, bar, row, CONSUMERS: gl.constexpr):
        """The CONSUMERS Q tiles from row ``row`` (one per consumer partition, consecutive)
        into ``q_s``, completing on ``bar``."""
        sub: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(bar, CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            _tma_load(q_desc, [row + c * sub, 0], bar, q_s.index(c))

    @gluon.jit
    def _release(desc, ring, ready, free, slot, tile, n_tiles, krow0, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, WS: gl.constexpr):
        """Ring slot ``slot`` (key tile ``tile``) has been read: hand it back to the producer
        partition (WS) or refill it with tile ``tile + STAGES`` (if there is one)."""
        if WS:
            mbarrier.arrive(free.index(slot), count=1)
        else:
            nxt = tile + STAGES
            if nxt < n_tiles:
                mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
                _tma_load(desc, [krow0 + nxt * BLOCK_N, 0], ready.index(slot),
                          ring.index(slot))

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, m0, n0, qk_scale2, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
        """(P, m, ℓ, correction) after the scores S = Q Kᵀ of key tile [n0, n0 + BLOCK_N)
        (unscaled); ``m_i`` is the running row maximum in log2 units (c·S), ``l_i`` the
        running row sum; the correction exp2(m_old − m) rescales O."""
        if CAUSAL:
            if n0 + BLOCK_N > m0 + 1:  # only the diagonal tiles hold masked pairs
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                vis = gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0)
                s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale2)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = gl.exp2(s * qk_scale2 - gl.expand_dims(m_use, 1))
        corr = gl.exp2(m_i - m_use)
        l_i = l_i * corr + gl.sum(p, axis=1)
        return p, m_new, l_i, corr

    @gluon.jit
    def _fwd_consumer(o_desc, LSE, q_s, k_ring, v_ring, q_bar, k_bar, v_bar, k_free, v_free,
                      row0, krow0, m0, n_tiles, qk_scale2, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                      STAGES: gl.constexpr, WS: gl.constexpr, k_desc, v_desc, turn,
                      ME: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
        """Key tiles [0, n_tiles) of the BLOCK_M queries from ``m0`` (their Q in ``q_s``),
        then the epilogue: O by TMA (staged through the Q buffer), L to LSE. Query rows from
        ``row0``, key rows from ``krow0`` (the kv head of the query head under GQA). A K slot
        is released as soon as its S is complete, a V slot once its P V is. WS: the rings are
        filled by the producer partition and each slot released on ``k_free`` / ``v_free``
        (by every consumer partition); otherwise this partition issues the copies itself.
        PINGPONG (two consumer partitions, this one number ME): the partitions take turns
        to issue their products (``turn``), so that one's softmax runs while the other's
        products are on the tensor cores."""
        dtype: gl.constexpr = q_s.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
        if not WS:  # fill the rings
            for s in gl.static_range(STAGES):
                if s < n_tiles:
                    _load_k(k_desc, k_ring, k_bar.index(s), s, krow0 + s * BLOCK_N)
                    _load_v(v_desc, v_ring, v_bar.index(s), s, krow0 + s * BLOCK_N)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bar.index(0), 0)
        st = warpgroup_mma(q_s, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
        _release(k_desc, k_ring, k_bar, k_free, 0, 0, n_tiles, krow0, BLOCK_N, STAGES, WS)
        p, m_i, l_i, corr = _softmax_tile(st, m_i, l_i, m0, 0, qk_scale2, BLOCK_M, BLOCK_N,
                                          CAUSAL, s_layout)
        for j in range(n_tiles - 1):
            slot = j % STAGES
            nslot = (j + 1) % STAGES
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            acc = acc * gl.expand_dims(gl.convert_layout(corr, row_acc), 1)
            # S of the next tile first, then P V of this one: the softmax below runs while
            # P V is on the tensor cores
            mbarrier.wait(k_bar.index(nslot), ((j + 1) // STAGES) & 1)
            if PINGPONG:  # V first too, then wait for our turn (partition 0 starts)
                mbarrier.wait(v_bar.index(slot), (j // STAGES) & 1)
                mbarrier.wait(turn.index(ME), (j + 1 - ME) & 1)
            st = warpgroup_mma(q_s, k_ring.index(nslot).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            if not PINGPONG:
                mbarrier.wait(v_bar.index(slot), (j // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(slot), acc, is_async=True)
            if PINGPONG:  # the other partition's turn
                mbarrier.arrive(turn.index(1 - ME), count=1)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
            _release(k_desc, k_ring, k_bar, k_free, nslot, j + 1, n_tiles, krow0, BLOCK_N,
                     STAGES, WS)
            p, m_i, l_i, corr = _softmax_tile(st, m_i, l_i, m0, (j + 1) * BLOCK_N,
                                              qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            _release(v_desc, v_ring, v_bar, v_free, slot, j, n_tiles, krow0, BLOCK_N, STAGES,
                     WS)
        last = n_tiles - 1
        slot = last % STAGES
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        acc = acc * gl.expand_dims(gl.convert_layout(corr, row_acc), 1)
        mbarrier.wait(v_bar.index(slot), (last // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_ring.index(slot), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))

        # rows that saw no key: ℓ = 0 -> O = 0, L = -inf
        empty_row = l_i == 0.0
        l_safe = gl.where(empty_row, 1.0, l_i)
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, row_acc), 1)
        lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(LSE + row0 + m0 + gl.arange(0, BLOCK_M, layout=row_s), lse)
        q_s.store(o.to(dtype))
        fence_async_shared()
        _tma_store(o_desc, [row0 + m0, 0], q_s)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fwd_producer(q_desc, k_desc, v_desc, q_s, k_ring, v_ring, q_bar, k_bar, v_bar,
                      k_free, v_free, row0, krow0, m0, n_tiles, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """Producer partition (one warp): the Q tile of each consumer partition, then key
        tiles [0, n_tiles) into the rings, K one tile ahead of V (K slots come back a softmax
        earlier than V slots), each slot refilled once the consumers have released it."""
        _load_q(q_desc, q_s, q_bar, row0 + m0, CONSUMERS)
        # a fresh barrier counts as having completed the phase before phase 0, so the first
        # pass over a ring does not wait
        _load_k(k_desc, k_ring, k_bar.index(0), 0, krow0)
        for i in range(n_tiles):
            if i + 1 < n_tiles:
                t = i + 1
                ks = t % STAGES
                mbarrier.wait(k_free.index(ks), ((t // STAGES) & 1) ^ 1)
                _load_k(k_desc, k_ring, k_bar.index(ks), ks, krow0 + t * BLOCK_N)
            vs = i % STAGES
            mbarrier.wait(v_free.index(vs), ((i // STAGES) & 1) ^ 1)
            _load_v(v_desc, v_ring, v_bar.index(vs), vs, krow0 + i * BLOCK_N)

    @gluon.jit
    def _gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N, GROUPS, qk_scale2,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                          CAUSAL: gl.constexpr, STAGES: gl.constexpr, WS: gl.constexpr,
                          CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
        """O and L of query tile ``program_id(0)`` (BLOCK_M queries) of (batch·query head)
        ``program_id(1)``. The descriptors view (B·H·N, d) tensors (H = H_q for Q and O,
        H_kv for K and V; (batch·query head) j reads (batch·kv head) j // GROUPS); Q and O
        tiles have BLOCK_M / CONSUMERS rows. LSE is the flat (B·H_q·N,) float32 output. WS
        adds the one-warp TMA producer; CONSUMERS = 2 (with WS) splits the query tile
        between two consumer partitions of ``num_warps`` warps each, which share the K / V
        rings but not their schedule (PINGPONG: they take turns to issue their products)."""
        row0 = gl.program_id(1) * N  # TMA coordinates are int32 (checked by the wrapper)
        krow0 = (gl.program_id(1) // GROUPS) * N
        m0 = row_tile(N, BLOCK_M, CAUSAL)
        n_tiles = key_tiles(m0, N, BLOCK_M, BLOCK_N, CAUSAL)
        SUB: gl.constexpr = BLOCK_M // CONSUMERS
        dtype: gl.constexpr = q_desc.dtype
        q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB, HEAD_DIM], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_bar.index(s), count=1)
            mbarrier.init(v_bar.index(s), count=1)
            mbarrier.init(k_free.index(s), count=CONSUMERS)
            mbarrier.init(v_free.index(s), count=CONSUMERS)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_fwd_consumer, (o_desc, LSE, q_s.index(0), k_ring, v_ring, q_bar, k_bar,
                                 v_bar, k_free, v_free, row0, krow0, m0, n_tiles, qk_scale2,
                                 SUB, BLOCK_N, HEAD_DIM, CAUSAL, STAGES, True, k_desc, v_desc,
                                 turn, 0, PINGPONG, num_warps)),
                (_fwd_consumer, (o_desc, LSE, q_s.index(1), k_ring, v_ring, q_bar, k_bar,
                                 v_bar, k_free, v_free, row0, krow0, m0 + SUB, n_tiles,
                                 qk_scale2, SUB, BLOCK_N, HEAD_DIM, CAUSAL, STAGES, True,
                                 k_desc, v_desc, turn, 1, PINGPONG, num_warps)),
                (_fwd_producer, (q_desc, k_desc, v_desc, q_s, k_ring, v_ring, q_bar, k_bar,
                                 v_bar, k_free, v_free, row0, krow0, m0, n_tiles, BLOCK_N,
                                 STAGES, CONSUMERS)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        elif WS:
            gl.warp_specialize([
                (_fwd_consumer, (o_desc, LSE, q_s.index(0), k_ring, v_ring, q_bar, k_bar,
                                 v_bar, k_free, v_free, row0, krow0, m0, n_tiles, qk_scale2,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, STAGES, True, k_desc,
                                 v_desc, turn, 0, False, num_warps)),
                (_fwd_producer, (q_desc, k_desc, v_desc, q_s, k_ring, v_ring, q_bar, k_bar,
                                 v_bar, k_free, v_free, row0, krow0, m0, n_tiles, BLOCK_N,
                                 STAGES, CONSUMERS)),
            ], [1], [PRODUCER_REGS])
        else:
            _load_q(q_desc, q_s, q_bar, row0 + m0, CONSUMERS)
            _fwd_consumer(o_desc, LSE, q_s.index(0), k_ring, v_ring, q_bar, k_bar, v_bar,
                          k_free, v_free, row0, krow0, m0, n_tiles, qk_scale2, BLOCK_M,
                          BLOCK_N, HEAD_DIM, CAUSAL, STAGES, False, k_desc, v_desc, turn, 0,
                          False, num_warps)


def _prepare(q, k, v, scale, causal, block_n, block_m, num_warps, stages, consumers=1,
             out=None):
    """Kernel arguments, meta-parameters and the outputs (o flat (B·H_q·N, d), lse flat
    (B·H_q·N,) float32; written into ``out`` = (o, lse) if given) of one launch, no checks,
    any device (scripts/kernels/gluon_compile_sm90.py builds CPU ones). ``num_warps``: all consumer
    warps (each of the ``consumers`` partitions gets num_warps / consumers)."""
    b, h, n, d = q.shape
    q2, k2, v2 = flat(q), flat(k), flat(v)
    if out is None:
        o2 = torch.empty_like(q2)
        lse = torch.empty(b * h * n, dtype=torch.float32, device=q.device)
    else:
        o2, lse = out[0].view(b * h * n, d), out[1].view(-1)
    q_desc, o_desc = tile_descriptors((q2, o2), block_m // consumers, d, q.dtype)
    k_desc, v_desc = tile_descriptors((k2, v2), block_n, d, q.dtype)
    args = (q_desc, k_desc, v_desc, o_desc, lse, n, h // k.shape[1], scale * LOG2E)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, CAUSAL=bool(causal),
                STAGES=stages, CONSUMERS=consumers, num_warps=num_warps // consumers)
    return args, meta, (o2, lse)


def launch_fwd(q, k, v, *, scale, causal, block_n, block_m, num_warps, stages,
               warp_specialize=False, consumers=1, pingpong=False, maxnreg=None, out=None):
    """Launch the pass without checks (the plan or the public entry point has verified the
    call): contiguous (B, H_q, N, d) ``q``, (B, H_kv, N, d) ``k``, ``v``; ``out``: the
    contiguous (o, lse) to write into ((B, H_q, N, d) and (B, H_q, N) float32), else
    allocated. Returns (o, lse) flat: (B·H_q·N, d) and (B·H_q·N,)."""
    b, h, n, d = q.shape
    args, meta, outs = _prepare(q, k, v, scale, causal, block_n, block_m, num_warps, stages,
                                consumers, out)
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    _gluon_fwd_kernel[(n // block_m, b * h)](*args, WS=bool(warp_specialize) or consumers > 1,
                                             PINGPONG=bool(pingpong) and consumers > 1,
                                             CONSUMER_REGS=CONSUMER_REGS,
                                             PRODUCER_REGS=PRODUCER_REGS, **meta)
    return outs


def gluon_attn_fwd(q, k, v, *, scale=None, causal=False, block_m=BLOCK_M, block_n=BLOCK_N,
                   num_warps=NUM_WARPS, stages=STAGES, warp_specialize=False, consumers=1,
                   pingpong=False, maxnreg=None):
    """O and L of softmax attention: the Triton forward's results (``attn_fwd``).

    q: (B, H_q, N, d) and k, v: (B, H_kv, N, d), bf16/fp16 on one sm_90 device, d 64 or 128,
    H_q a multiple of H_kv (GQA: query head h reads kv head h // (H_q / H_kv)), N a multiple
    of ``block_m`` and ``block_n``; ``causal``: query i sees keys j ≤ i. Returns (o, lse):
    o (B, H_q, N, d) in q's dtype, lse (B, H_q, N) float32, the natural-log row log-sum-exp
    of τ Q Kᵀ (τ = ``scale``, default d^-1/2), as ``attn_fwd`` returns them. Inputs that are
    not contiguous are copied.

    ``block_m`` queries per program (16 per warp: block_m == 16·num_warps, num_warps 4 or
    8), ``block_n`` keys per step (32, 64 or 128), ``stages`` ring slots (2 to 4),
    ``warp_specialize`` adds a one-warp TMA producer partition, ``consumers=2`` (with
    ``warp_specialize`` and 8 warps) splits the query tile between two 4-warp consumer
    partitions that share the K / V ring, ``pingpong`` (with ``consumers=2``) makes them
    take turns to issue their products, ``maxnreg`` caps ptxas's registers per thread
    (None: no cap).
    """
    fn = "gluon_attn_fwd"
    b, h, n, d = check_args(fn, q, k, (("k", k, True), ("v", v, True)), (), None,
                            block_n=block_n, block_m=block_m, num_warps=num_warps,
                            per_warp="block_m", stages=stages, available=available(q.device))
    if b * h * n == 0:
        raise ValueError(f"{fn}: q has no rows (shape {tuple(q.shape)}); use attn_fwd for "
                         "empty inputs")
    if consumers not in (1, 2) or (consumers == 2 and not (warp_specialize and num_warps == 8)):
        raise ValueError(f"{fn}: consumers must be 1, or 2 with warp_specialize=True and "
                         f"num_warps=8, got consumers={consumers}, "
                         f"warp_specialize={warp_specialize}, num_warps={num_warps}")
    if pingpong and consumers != 2:
        raise ValueError(f"{fn}: pingpong=True needs consumers=2")
    scale = d ** -0.5 if scale is None else float(scale)
    o, lse = launch_fwd(q, k, v, scale=scale, causal=causal, block_n=block_n, block_m=block_m,
                        num_warps=num_warps, stages=stages, warp_specialize=warp_specialize,
                        consumers=consumers, pingpong=pingpong, maxnreg=maxnreg)
    return o.view(b, h, n, d), lse.view(b, h, n)
