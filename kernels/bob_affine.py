"""BoB affine row pass (``precise=False``): one program per (query tile, query head, batch),
looping over key tiles, with the two-pass affine form of bob-math.md ("Why two passes
suffice"): six α-free tile x d accumulators and four row sums, α and E formed at the end of
the row, so no statistics pass runs first. It loses accuracy where attention is peaked (the
α (P∘dP) K and E (P K) terms cancel); the precise passes are bob_row.py. Float32 inputs
(ROWSUM) recompute P in natural units and scale by ρ = 1 / rowsum(exp(S − L)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bob_row import _bob_row_setup, _bob_row_tile
from .common import _NO_SPECIALIZE, _load_rowvec, _load_view, _row_program, _store_view


@triton.jit
def _rowsum_scale(r_p, ROWSUM: tl.constexpr):
    """ρ = 1 / rowsum(P) (1 for rows that see no key, or without ROWSUM)."""
    if ROWSUM:
        return 1.0 / tl.where(r_p > 0.0, r_p, 1.0)
    else:
        return tl.full(r_p.shape, 1.0, tl.float32)



@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_affine_kernel(
    Q, K, V, O, DO, UQ, UK, UV, QB, DOB, LSE, DELTA, ALPHA, EE, RHO, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, NEED_E: tl.constexpr,
    WRITE_STATS: tl.constexpr, ROWSUM: tl.constexpr,
):
    """Affine row pass (bob-math.md, "Why two passes suffice"): six α-free accumulators

        dS U_K,  (P∘(G∘(dP−D)+B)) K,  (P∘dP) K,  P K,  (P∘G) V,  P U_V

    and the row sums rowsum(P), α, rowsum(P∘G∘dP), rowsum(P∘B); at the end of the row
    Q̄ = τ [dS U_K + (P∘(G∘(dP−D)+B)) K − α (P∘dP) K − E (P K)], dŌ = (P∘G) V + P U_V − α O.
    Writes α, E + αD (and with ROWSUM ρ) to ALPHA, EE (RHO) when WRITE_STATS (the column pass
    follows; None otherwise). NEED_E: dP and B are needed (for Q̄ or for E)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row = _bob_row_setup(
        Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, n_k,
        window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
        LONG, HAS_UQ, HAS_UK, HAS_UV, ROWSUM)
    delta = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    a_dsuk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_tk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pdpk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pgv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_puv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_alpha = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_gdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_b = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, b_tile = _bob_row_tile(
            row, start_n, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK,
            HAS_UV, HAS_G, NEED_E, ROWSUM)
        if ROWSUM:
            r_p += tl.sum(p, 1)
        pg = p
        pb = p
        if HAS_G:
            pg = p * g
            r_alpha += tl.sum(pg, 1)
            if NEED_E:
                r_gdp += tl.sum(pg * dp, 1)
        if HAS_UV:
            if NEED_E:
                pb = p * b_tile
                r_b += tl.sum(pb, 1)
        if NEED_QB:
            if HAS_UK:
                ds = p * (dp - delta[:, None])
                a_dsuk = tl.dot(ds.to(uk.dtype), uk, a_dsuk, input_precision=PREC)
            if HAS_G:
                t = pg * (dp - delta[:, None])
                if HAS_UV:
                    t += pb
                a_pdpk = tl.dot((p * dp).to(k.dtype), k, a_pdpk, input_precision=PREC)
            else:
                t = pb
            a_tk = tl.dot(t.to(k.dtype), k, a_tk, input_precision=PREC)
            a_pk = tl.dot(p.to(k.dtype), k, a_pk, input_precision=PREC)
        if NEED_DOB:
            if HAS_G:
                a_pgv = tl.dot(pg.to(v.dtype), v, a_pgv, input_precision=PREC)
            if HAS_UV:
                a_puv = tl.dot(p.to(uv.dtype), uv, a_puv, input_precision=PREC)
    rho = _rowsum_scale(r_p, ROWSUM)
    alpha = r_alpha * rho
    e = (r_gdp + r_b) * rho - 2.0 * alpha * delta  # E
    if NEED_QB:
        qb = (a_dsuk + a_tk - alpha[:, None] * a_pdpk - e[:, None] * a_pk) * (rho * scale)[:, None]
        _store_view(QB, b64, h64, q_start64, rows_m, qb, m_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_DOB:
        dob = (a_pgv + a_puv) * rho[:, None]
        if HAS_G:
            o = _load_view(O, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
            dob -= alpha[:, None] * o.to(tl.float32)
        _store_view(DOB, b64, h64, q_start64, rows_m, dob, m_ok, offs_d, HEAD_DIM, EVEN_D)
    if WRITE_STATS:
        tl.store(ALPHA + row_off + offs_m, alpha, mask=m_ok)
        tl.store(EE + row_off + offs_m, e + alpha * delta, mask=m_ok)  # E + αD
        if ROWSUM:
            tl.store(RHO + row_off + offs_m, rho, mask=m_ok)
