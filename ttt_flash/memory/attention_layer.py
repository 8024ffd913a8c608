"""GradientMemoryAttention: an attention layer that reads memory slots plus the current chunk
and writes each chunk into the slots by gradient steps through softmax attention.

Imports torch, :mod:`ttt_flash.attention.registry` and
:mod:`ttt_flash.memory._common`; never Lightning.
"""

from __future__ import annotations

import math
import numbers

from typing import Literal, Optional, Tuple

import torch
from einops import rearrange
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_int
from ..attention.registry import attend, check_attention
from ._common import inner_grad_mode, log_lr_parameter, inner_step

__all__ = ["MEMORY_ATTENTION_IMPLS", "MemoryAttentionName", "WRITE_RULES", "WriteRule", "SLOT_QUERIES", "SlotQuery",
           "GradientMemoryAttention"]

#: Accepted values of the ``attention`` argument of :class:`GradientMemoryAttention`: the
#: implementations of :mod:`ttt_flash.attention.registry` with a double backward on every device (SDPA's
#: fused CUDA kernels have none, and the write differentiates through attention).
MEMORY_ATTENTION_IMPLS = ("ttt_flash", "math")

#: The type of the ``attention`` argument of :class:`GradientMemoryAttention` (and its recipes).
MemoryAttentionName = Literal["ttt_flash", "math"]

#: Accepted values of the ``write_rule`` argument of :class:`GradientMemoryAttention`.
WRITE_RULES = ("gradient", "slot_normalized")

#: The type of the ``slot_query`` argument of :class:`GradientMemoryAttention` (and its recipes).
SlotQuery = Literal["query", "key"]

#: Accepted values of the ``slot_query`` argument of :class:`GradientMemoryAttention`: what a
#: token reads the slots with (its query, or the key that addresses its own write).
SLOT_QUERIES = ("query", "key")

#: The type of the ``write_rule`` argument of :class:`GradientMemoryAttention` (and its recipes).
WriteRule = Literal["gradient", "slot_normalized"]


class GradientMemoryAttention(nn.Module):
    r"""Attention over gradient-written memory slots plus causal attention within a chunk.

    Per head (dimension D, scale τ = D^{-1/2}), with projections q_t, k_t, v_t of the input
    and S slots with keys K ∈ R^{S×D} and values V ∈ R^{S×D} (initial K_0, V_0 learned), the
    sequence is cut into chunks c = 1, 2, … of C tokens. Chunk c

    1. reads: o_t = softmax(τ q_t [K_c; k_{c,≤t}]ᵀ) [V_c; v_{c,≤t}] for t in chunk c — one
       causal attention call with the S slot keys in front of the chunk's keys and the
       mask aligned bottom-right, so every query sees all slots and the chunk up to itself;
    2. is written (not after the last chunk) by ``inner_steps`` gradient steps on the
       reconstruction loss through softmax attention over the slots, addressed by the
       chunk's keys:

           ℓ_c(K, V) = (1 / 2C) Σ_{t ∈ c} ‖ softmax(τ k_t Kᵀ) V − v_t ‖²
           (K, V) ← (K, V) − η ∇_{(K, V)} ℓ_c(K, V)

       with η = e^{log η} learned. With ``write_gate``, token t's term is weighted by a
       learned gate β_t = 2 σ(w_h · x_t + b_h) ∈ (0, 2) per head (w, b initialised to 0, so
       β = 1 and the layer is unchanged at initialisation): the layer can learn which tokens
       to write, e.g. to leave filler out of the memory. The write keeps its graph (``create_graph=True``), so
       the outer loss differentiates through every write (second order: exact through
       :func:`ttt_flash.flash_attention`).

    ``write_rule`` picks the write step:

    * ``"gradient"`` (above): keys and values stepped by η ∇ℓ_c. Its step is stable only
      while η times the curvature of ℓ_c stays below 2, and the curvature of the key step
      grows with the norms of the keys and values: with long contexts (hundreds of writes)
      and growing projections the slots can diverge.
    * ``"slot_normalized"``: a normalised step on the values only (the slot keys stay the
      learned K_0, so addressing is by content against fixed keys). With the summed loss
      L_c(V) = ½ Σ_t β_t ‖a_t V − v_t‖², a_t = softmax(τ k_t K_0ᵀ) ∈ R^S, each slot's step
      is divided by the (gated) attention mass it receives, m_s = Σ_t β_t a_{t,s}:

          V_s ← V_s − min(η, 1) · ∂L_c/∂V_s / max(1, m_s)

      A slot addressed by one token alone (m_s ≤ 1) takes the plain gradient step of that
      token (η = 1 with a one-hot address writes v_t exactly); a slot that many tokens
      address takes the step of their weighted mean error, whatever the chunk length. The
      step is scale-free: the preconditioned Hessian diag(max(1, m))⁻¹ Aᵀ diag(β) A has
      row sums m_s / max(1, m_s) ≤ 1 (Gershgorin), so every write contracts for any keys,
      values, chunk length and number of writes (the slots stay bounded by the values
      written). ∂L_c/∂V goes through the attention implementation with its graph kept, so
      training stays exact second order through every write.

      Because the slot keys are fixed, A_c does not depend on the values and one step is
      affine in V: V ← M_c V + U_c (:meth:`parallel_values`). With ``parallel_write``
      (default) every chunk's A_c, M_c, U_c come from a few batched products and only that
      recurrence runs chunk after chunk, one small matrix product per write; the numbers are
      those of one autograd step through ``attend`` per chunk (``parallel_write=False``), to
      rounding, first and second derivatives included.

    Addressing (what makes a pair retrievable; docs/memory.md):

    * ``qk_norm``: q_t, k_t and the slot keys are L2-normalised per head and every score
      is g_h · cos with a learned temperature g_h (initially ``qk_scale``). Raw projections
      start small, so softmax(τ k_t K₀ᵀ) is nearly uniform and every token writes every
      slot: the read then returns the mean of the context's values. Unit vectors at g = 10
      give distinct keys distinct addresses from the first step.
    * ``kv_shift``: token t's value is written at token t − 1's key (k_{t−1}, v_t): a
      value lands where its key token addresses the slots.
    * ``slot_query="key"``: tokens score the slots with the key-side address that their
      writes use (g k̂_t) instead of their query (the chunk is still read with q_t, in the
      same softmax). A later token carrying the same key looks up exactly the slots that the
      key's pair was written to, before any training.

    Output: ``proj(o)``. Each sequence and head has its own slots; no positions are used
    (order enters through the causal mask and the chunk order), so RoPE tables passed by a
    host model (e.g. :class:`~ttt_flash.models.Block` calls ``attn(x, cos, sin)``) are
    accepted and ignored: ``block.attn = GradientMemoryAttention(...)`` replaces a GPT's
    attention.

    Args:
        d_model: input and output width.
        heads: number of heads (d_model divisible by it).
        memory_slots: S.
        inner_steps: gradient steps per write.
        inner_lr: initial η.
        chunk_size: C.
        attention: ``"ttt_flash"`` or ``"math"`` (materialised softmax, for tests).
        first_order: treat the write gradients as constants.
        learn_inner_lr: train log η.
        bias: biases in the projections.
        write_gate: learn the per-token, per-head write gate β_t (above).
        write_rule: ``"gradient"`` or ``"slot_normalized"`` (above). With
            ``"slot_normalized"``, ``inner_lr`` must be <= 1 (the step is min(η, 1)).
        qk_norm: unit-norm queries, keys and initial slot keys at a learned per-head
            temperature (``"gradient"`` then writes the slot keys off the unit sphere).
        qk_scale: the temperature's initial value (> 0).
        parallel_write: compute ``"slot_normalized"`` writes for all chunks at once
            (above; ignored by ``"gradient"``).
        kv_shift: write each token's value at the previous token's key.
        slot_query: ``"query"`` or ``"key"``: what a token scores the slots with.

    Example::

        >>> import torch
        >>> from ttt_flash.memory import GradientMemoryAttention
        >>> layer = GradientMemoryAttention(32, 4, memory_slots=8, inner_steps=1, inner_lr=1.0, chunk_size=16)
        >>> layer(torch.randn(2, 40, 32)).shape
        torch.Size([2, 40, 32])
        >>> recall = GradientMemoryAttention(32, 4, memory_slots=64, chunk_size=16, write_rule="slot_normalized",
        ...                                  qk_norm=True, kv_shift=True, slot_query="key")
        >>> recall(torch.randn(2, 40, 32)).shape
        torch.Size([2, 40, 32])
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        memory_slots: int = 16,
        inner_steps: int = 1,
        inner_lr: float = 1.0,
        chunk_size: int = 64,
        *,
        attention: str = "ttt_flash",
        first_order: bool = False,
        learn_inner_lr: bool = True,
        bias: bool = False,
        write_gate: bool = False,
        write_rule: str = "gradient",
        qk_norm: bool = False,
        qk_scale: float = 10.0,
        parallel_write: bool = True,
        kv_shift: bool = False,
        slot_query: str = "query",
    ):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("heads", heads, 1)
        check_int("memory_slots", memory_slots, 1)
        check_int("inner_steps", inner_steps, 0)
        check_int("chunk_size", chunk_size, 1)
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        check_attention(attention, MEMORY_ATTENTION_IMPLS)
        if write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {write_rule!r}")
        if isinstance(inner_lr, numbers.Real) and not isinstance(inner_lr, bool) and not math.isfinite(inner_lr):
            raise ValueError(f"inner_lr must be a finite float > 0 (the write step size η), got {inner_lr!r}")
        if write_rule == "slot_normalized" and isinstance(inner_lr, (int, float)) and inner_lr > 1:
            raise ValueError(
                f"write_rule='slot_normalized' takes a step of min(inner_lr, 1) per slot; got inner_lr={inner_lr}. "
                "Pass inner_lr <= 1 (1 writes a lone token's value exactly)"
            )
        if isinstance(qk_scale, bool) or not isinstance(qk_scale, numbers.Real) or not (0 < qk_scale < math.inf):
            raise ValueError(f"qk_scale must be a finite float > 0 (the initial temperature of qk_norm), got {qk_scale!r}")
        self.write_rule = write_rule
        self.heads, self.head_dim = heads, d_model // heads
        self.inner_steps, self.chunk_size = inner_steps, chunk_size
        self.attention, self.first_order = attention, bool(first_order)
        self.parallel_write = bool(parallel_write)
        self.kv_shift = bool(kv_shift)
        if slot_query not in SLOT_QUERIES:
            raise ValueError(f"slot_query must be one of {SLOT_QUERIES}, got {slot_query!r}")
        self.slot_query = slot_query
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.slot_k = nn.Parameter(torch.randn(heads, memory_slots, self.head_dim))
        self.slot_v = nn.Parameter(torch.zeros(heads, memory_slots, self.head_dim))
        self.log_inner_lr = log_lr_parameter(inner_lr, learn_inner_lr)
        self.log_qk_scale: Optional[nn.Parameter] = None
        if qk_norm:
            self.log_qk_scale = nn.Parameter(torch.full((heads, 1, 1), math.log(float(qk_scale))))
        self.write_gate: Optional[nn.Linear] = None
        if write_gate:
            self.write_gate = nn.Linear(d_model, heads)
            nn.init.zeros_(self.write_gate.weight)
            nn.init.zeros_(self.write_gate.bias)

    @property
    def qk_norm(self) -> bool:
        """Whether queries, keys and slot keys are L2-normalised with a learned temperature."""
        return self.log_qk_scale is not None

    @property
    def inner_lr(self) -> Tensor:
        """The step size η the writes use: e^{log η} (``"slot_normalized"``: min(e^{log η}, 1))."""
        lr = self.log_inner_lr.exp()
        return lr.clamp(max=1.0) if self.write_rule == "slot_normalized" else lr

    def write_loss(self, slot_k: Tensor, slot_v: Tensor, k: Tensor, v: Tensor,
                   gate: Optional[Tensor] = None) -> Tensor:
        """ℓ_c summed over batch and heads: slots (B, H, S, D), chunk keys/values (B, H, C, D),
        ``gate`` (B, H, C, 1) the tokens' weights β_t (None: 1)."""
        recon = attend(k, slot_k, slot_v, impl=self.attention, causal=False)
        err = (recon - v).square()
        if gate is not None:
            err = err * gate
        return 0.5 * err.sum() / k.shape[2]

    def slot_mass(self, slot_k: Tensor, k: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        """m_s = Σ_t β_t softmax(τ k_t Kᵀ)_s: the (gated) attention mass each slot receives from
        a chunk. ``slot_k`` (B, H, S, D), ``k`` (B, H, C, D), ``gate`` (B, H, C, 1) or None →
        (B, H, S). Materialised (C × S per head: small); differentiable to any order."""
        addr = torch.softmax((k @ slot_k.transpose(-1, -2)) * self.head_dim ** -0.5, dim=-1)
        if gate is not None:
            addr = addr * gate
        return addr.sum(dim=2)

    def write(self, slot_k: Tensor, slot_v: Tensor, k: Tensor, v: Tensor,
              first_order: Optional[bool] = None, gate: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The slots after writing one chunk (``inner_steps`` steps of ``write_rule``); ``gate``:
        the tokens' (B, H, C, 1) write weights (None: 1)."""
        first_order = self.first_order if first_order is None else first_order
        track, create_graph = inner_grad_mode(first_order)
        lr = self.inner_lr
        if self.write_rule == "slot_normalized":
            # per-slot step min(η, 1) / max(1, m_s) on the summed loss (class docstring)
            step = (lr / self.slot_mass(slot_k, k, gate).clamp_min(1.0)).unsqueeze(-1)
            loss_fn = lambda sv: self.write_loss(slot_k, sv, k, v, gate) * k.shape[2]  # noqa: E731
            for _ in range(self.inner_steps):
                (slot_v,), _ = inner_step(loss_fn, (slot_v,), step, track=track, create_graph=create_graph)
            return slot_k, (slot_v if track else slot_v.detach())
        for _ in range(self.inner_steps):
            (slot_k, slot_v), _ = inner_step(lambda sk, sv: self.write_loss(sk, sv, k, v, gate), (slot_k, slot_v), lr,
                                             track=track, create_graph=create_graph)
        if not track:
            slot_k, slot_v = slot_k.detach(), slot_v.detach()
        return slot_k, slot_v

    def addresses(self, q: Tensor, k: Tensor, slot_k: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The vectors attention sees: ``(q, k, k_addr, slot_k)`` from the projections q, k
        (B, H, N, D) and the slot keys (B, H, S, D). Without ``qk_norm`` they are q, k, k and
        the slot keys; with it, q̂ g √D, k̂, k̂ g √D and K̂ (unit rows, g = e^{log g} the
        head's learned temperature), so that every score τ·(·) is g times a cosine.
        ``k_addr`` addresses the slots in the write (it plays the query there)."""
        if self.log_qk_scale is None:
            return q, k, k, slot_k
        scale = (self.log_qk_scale.exp() * self.head_dim ** 0.5).to(q.dtype)
        k = F.normalize(k, dim=-1)
        return F.normalize(q, dim=-1) * scale, k, k * scale, F.normalize(slot_k, dim=-1)

    def parallel_values(self, slot_k: Tensor, slot_v: Tensor, k: Tensor, v: Tensor,
                        gate: Optional[Tensor] = None, first_order: Optional[bool] = None) -> Tensor:
        r"""The slot values after each of W chunk writes of the ``"slot_normalized"`` rule, all
        chunks' addresses at once.

        The slot keys K stay fixed, so chunk c's address matrix A_c = softmax(τ k_c Kᵀ)
        (C × S per head) does not depend on the values and one inner step is affine in V:

            V ← V − D_c (G_c V − P_c) = M_c V + U_c,
            G_c = A_cᵀ diag(β) A_c,  P_c = A_cᵀ diag(β) v_c,  D_c = diag(min(η, 1) / max(1, m_c)),

        with M_c = I − D_c G_c and U_c = D_c P_c, exactly the gradient step of the summed
        write loss (∂L_c/∂V = G_c V − P_c). All A_c, M_c, U_c come from a few batched
        products; only the recurrence V_{c+1} = M_c V_c + U_c (``inner_steps`` times per
        chunk) runs chunk after chunk, one batched matrix product each. Plain autograd through
        it is the exact second-order outer gradient (``first_order``: the step's G_c V − P_c
        is a constant, as with ``create_graph=False``).

        Args:
            slot_k, slot_v: (B, H, S, D) slot keys (as attention sees them) and initial values.
            k: (B, H, W·C, D) the writing chunks' addressing keys (``k_addr`` of
                :meth:`addresses`), v: (B, H, W·C, D) their values.
            gate: (B, H, W·C, 1) the tokens' write weights β_t, or None (1).

        Returns:
            (B, H, W + 1, S, D): the values before the first write and after each write.
        """
        first_order = self.first_order if first_order is None else first_order
        track, create_graph = inner_grad_mode(first_order)
        b, h, s, d = slot_v.shape
        c = self.chunk_size
        w = k.shape[2] // c
        if w == 0 or self.inner_steps == 0:
            return slot_v.unsqueeze(2).expand(b, h, w + 1, s, d)
        with torch.set_grad_enabled(track):
            kw, vw = k.reshape(b, h, w, c, d), v.reshape(b, h, w, c, d)
            addr = torch.softmax((kw @ slot_k.unsqueeze(2).transpose(-1, -2)) * d ** -0.5, dim=-1)  # (B,H,W,C,S)
            weighted = addr if gate is None else addr * gate.reshape(b, h, w, c, 1)
            step = (self.inner_lr / weighted.sum(3).clamp_min(1.0)).unsqueeze(-1)  # (B,H,W,S,1)
            gram = weighted.transpose(-1, -2) @ addr  # G_c (B,H,W,S,S)
            target = weighted.transpose(-1, -2) @ vw  # P_c (B,H,W,S,D)
            # chunk-major, (B·H) batched: one contiguous matrix product per write
            flat = lambda t: t.permute(2, 0, 1, 3, 4).reshape(w, b * h, *t.shape[3:])  # noqa: E731
            value = slot_v.reshape(b * h, s, d)
            states = [value]
            if create_graph or not track:
                eye = torch.eye(s, dtype=slot_v.dtype, device=slot_v.device)
                mats, offs = flat(eye - step * gram).unbind(0), flat(step * target).unbind(0)
                for mat, off in zip(mats, offs):
                    for _ in range(self.inner_steps):
                        value = torch.baddbmm(off, mat, value)
                    states.append(value)
            else:  # first order: the step direction G_c V − P_c is a constant
                grams, targets, steps = flat(gram).unbind(0), flat(target).unbind(0), flat(step).unbind(0)
                for g_c, p_c, d_c in zip(grams, targets, steps):
                    for _ in range(self.inner_steps):
                        value = value - d_c * torch.baddbmm(p_c, g_c, value, alpha=1, beta=-1).detach()
                    states.append(value)
            out = torch.stack(states, 0).reshape(w + 1, b, h, s, d).permute(1, 2, 0, 3, 4)
        return out

    def read(self, q: Tensor, k: Tensor, v: Tensor, slot_k: Tensor, slot_v: Tensor,
             slot_q: Optional[Tensor] = None) -> Tensor:
        """Every chunk's read in one attention call: q, k, v (B, H, N, D); ``slot_k``,
        ``slot_v`` (B, H, n_chunks, S, D) the slots chunk i reads (i = 0 … ⌈N/C⌉ − 1) →
        (B, H, N, D). The chunks become heads of one causal call with the S slot keys in
        front of each chunk's keys (the mask aligned bottom-right). ``slot_q`` (B, H, N, D):
        the tokens score the slots with it instead of q (one softmax all the same: the call
        runs on the concatenated features [q, slot_q] against [k, 0] and [0, slot keys])."""
        if slot_q is not None:
            zeros = torch.zeros_like(slot_k)
            out = self.read(math.sqrt(2.0) * torch.cat([q, slot_q], dim=-1), torch.cat([k, torch.zeros_like(k)], -1),
                            torch.cat([v, torch.zeros_like(v)], -1), torch.cat([zeros, slot_k], -1),
                            torch.cat([slot_v, zeros], -1))
            return out[..., : q.shape[-1]]
        b, h, n, d = q.shape
        c, s = self.chunk_size, slot_v.shape[3]
        full = n // c
        outs = []
        if full:
            fold = lambda t: t[:, :, : full * c].reshape(b, h * full, c, d)  # noqa: E731
            keys = torch.cat([slot_k[:, :, :full], k[:, :, : full * c].reshape(b, h, full, c, d)], dim=3)
            values = torch.cat([slot_v[:, :, :full], v[:, :, : full * c].reshape(b, h, full, c, d)], dim=3)
            out = attend(fold(q), keys.reshape(b, h * full, s + c, d), values.reshape(b, h * full, s + c, d),
                         impl=self.attention, causal=True)
            outs.append(out.reshape(b, h, full * c, d))
        if n > full * c:
            keys = torch.cat([slot_k[:, :, full], k[:, :, full * c:]], dim=2)
            values = torch.cat([slot_v[:, :, full], v[:, :, full * c:]], dim=2)
            outs.append(attend(q[:, :, full * c:], keys, values, impl=self.attention, causal=True))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def forward(self, x: Tensor, *unused, write: bool = True, **unused_kw) -> Tensor:
        """x: (B, N, d_model) → (B, N, d_model). ``write=False`` never writes (every chunk
        reads the initial slots: the pre-write baseline). Other arguments are ignored.
        An empty sequence (N = 0) gives an empty (B, 0, d_model) output."""
        width = self.qkv.in_features
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(
                f"GradientMemoryAttention expects x of shape (batch, seq_len, d_model={width}), got "
                f"{tuple(x.shape)}" + ("; add a batch dimension with x.unsqueeze(0)" if x.dim() == 2 else "")
            )
        batch, n, _ = x.shape
        if n == 0:
            return self.proj(x.new_zeros(batch, 0, self.proj.in_features))
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        gate = None
        if self.write_gate is not None:
            gate = rearrange(2 * torch.sigmoid(self.write_gate(x)), "b n h -> b h n 1").to(q.dtype)
        slot_k = self.slot_k.unsqueeze(0).expand(batch, -1, -1, -1).to(q.dtype)
        slot_v = self.slot_v.unsqueeze(0).expand(batch, -1, -1, -1).to(q.dtype)
        q, k, k_addr, slot_k = self.addresses(q, k, slot_k)
        k_read = k_addr
        if self.kv_shift:  # token t writes its value at token t-1's key; token 0 writes nothing
            k_addr = torch.cat([torch.zeros_like(k_addr[:, :, :1]), k_addr[:, :, :-1]], dim=2)
            first = torch.ones(n, 1, dtype=q.dtype, device=q.device)
            first[0] = 0.0
            gate = first.expand(batch, self.heads, n, 1) if gate is None else gate * first
        chunks = -(-n // self.chunk_size)
        writes = chunks - 1 if write else 0  # every chunk but the last is written; all of them are full
        span = writes * self.chunk_size
        wgate = None if gate is None else gate[:, :, :span]
        if writes and self.write_rule == "slot_normalized" and self.parallel_write:
            values = self.parallel_values(slot_k, slot_v, k_addr[:, :, :span], v[:, :, :span], wgate)
            keys = slot_k.unsqueeze(2).expand(-1, -1, writes + 1, -1, -1)
        else:
            keys_list, values_list = [slot_k], [slot_v]
            sk, sv = slot_k, slot_v
            for i in range(writes):
                lo, hi = i * self.chunk_size, (i + 1) * self.chunk_size
                sk, sv = self.write(sk, sv, k_addr[:, :, lo:hi], v[:, :, lo:hi],
                                    gate=None if gate is None else gate[:, :, lo:hi])
                keys_list.append(sk)
                values_list.append(sv)
            keys, values = torch.stack(keys_list, dim=2), torch.stack(values_list, dim=2)
        if writes + 1 < chunks:  # write=False: every chunk reads the initial slots
            keys = keys[:, :, :1].expand(-1, -1, chunks, -1, -1)
            values = values[:, :, :1].expand(-1, -1, chunks, -1, -1)
        out = self.read(q, k, v, keys, values, slot_q=k_read if self.slot_query == "key" else None)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))
