"""GradientMemoryAttention: an attention layer that reads memory slots plus the current chunk
and writes each chunk into the slots by gradient steps through softmax attention.
"""

from __future__ import annotations

import math
import numbers

from typing import Literal, Optional, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn

from .._checks import check_int
from ..impls import attend, check_attention
from ._common import inner_grad_mode, log_lr_parameter, inner_step

__all__ = ["MEMORY_ATTENTION_IMPLS", "MemoryAttentionName", "WRITE_RULES", "WriteRule", "GradientMemoryAttention"]

#: Accepted values of the ``attention`` argument of :class:`GradientMemoryAttention`: the
#: implementations of :mod:`ttt_flash.impls` with a double backward on every device (SDPA's
#: fused CUDA kernels have none, and the write differentiates through attention).
MEMORY_ATTENTION_IMPLS = ("ttt_flash", "math")

#: The type of the ``attention`` argument of :class:`GradientMemoryAttention` (and its recipes).
MemoryAttentionName = Literal["ttt_flash", "math"]

#: Accepted values of the ``write_rule`` argument of :class:`GradientMemoryAttention`.
WRITE_RULES = ("gradient", "slot_normalized")

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

    Example::

        >>> import torch
        >>> from ttt_flash.memory import GradientMemoryAttention
        >>> layer = GradientMemoryAttention(32, 4, memory_slots=8, inner_steps=1, inner_lr=1.0, chunk_size=16)
        >>> layer(torch.randn(2, 40, 32)).shape
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
        self.write_rule = write_rule
        self.heads, self.head_dim = heads, d_model // heads
        self.inner_steps, self.chunk_size = inner_steps, chunk_size
        self.attention, self.first_order = attention, bool(first_order)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.slot_k = nn.Parameter(torch.randn(heads, memory_slots, self.head_dim))
        self.slot_v = nn.Parameter(torch.zeros(heads, memory_slots, self.head_dim))
        self.log_inner_lr = log_lr_parameter(inner_lr, learn_inner_lr)
        self.write_gate: Optional[nn.Linear] = None
        if write_gate:
            self.write_gate = nn.Linear(d_model, heads)
            nn.init.zeros_(self.write_gate.weight)
            nn.init.zeros_(self.write_gate.bias)

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
        outs = []
        for start in range(0, n, self.chunk_size):
            end = min(n, start + self.chunk_size)
            qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            keys, values = torch.cat([slot_k, kc], dim=2), torch.cat([slot_v, vc], dim=2)
            outs.append(attend(qc, keys, values, impl=self.attention, causal=True))
            if write and end < n:
                slot_k, slot_v = self.write(slot_k, slot_v, kc, vc,
                                            gate=None if gate is None else gate[:, :, start:end])
        return self.proj(rearrange(torch.cat(outs, dim=2), "b h n d -> b n (h d)"))
