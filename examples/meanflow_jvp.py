"""MeanFlow-style training of a tiny transformer, back-propagating through a jvp of attention.

A flow map u_θ(z, r, t) predicts the average velocity of the probability-flow ODE between
times r and t. MeanFlow (Geng et al., 2025) trains it with the identity

    u(z_t, r, t) = v − (t − r) · d/dt u(z_t, r, t),      d/dt u = ∂_z u · v + ∂_t u,

where z_t = (1 − t) x + t ε is a point on the straight path from data x to noise ε and
v = ε − x its velocity. The total derivative d/dt u is one forward-mode product (a jvp of the
network in direction (v, 0, 1)), which goes through every attention layer: with
:func:`ttt_flash.flash_attention` it is exact, and so is the backward through it.

Two losses:

* ``--stop-gradient`` (MeanFlow as published): ‖u − sg(v − (t − r) d/dt u)‖²; the jvp is
  computed but not differentiated.
* default (a flow-map residual, as in Lagrangian / Eulerian flow-map matching):
  ‖u + (t − r) d/dt u − v‖², back-propagated through the jvp, i.e. through the tangent of
  every attention layer (``_AttentionTangent``'s backward: the first backward plus the BoB).

The data are short sequences of 2-D points on a noisy circle (each sequence a rotated arc),
so attention has structure to learn. :func:`main` also checks one step's gradients against
the same model with materialised attention (float64, equal to rounding).

Run (CPU, seconds)::

    python examples/meanflow_jvp.py --steps 30
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from ttt_flash import flash_attention
from ttt_flash.attention.reference import naive_attention


class Block(nn.Module):
    """Pre-norm transformer block: multi-head self-attention (non-causal) and a GELU MLP."""

    def __init__(self, dim: int, heads: int, attention: str):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = flash_attention if self.attention == "ttt_flash" else naive_attention
        x = x + self.proj(attn(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class FlowTransformer(nn.Module):
    """u_θ(z, r, t): (B, N, 2) points and (B,) times r <= t -> (B, N, 2) average velocity."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2, attention: str = "ttt_flash"):
        super().__init__()
        self.inp = nn.Linear(2, dim)
        self.time = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.out = nn.Linear(dim, 2)

    def forward(self, z, r, t):
        emb = torch.stack([torch.sin(math.pi * t), torch.cos(math.pi * t), t - r, torch.sin(math.pi * r)], -1)
        x = self.inp(z) + self.time(emb)[:, None]
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make_batch(gen: torch.Generator, batch: int, seq_len: int, dtype=torch.float32):
    """Arcs of a noisy unit circle: (B, N, 2)."""
    start = torch.rand(batch, 1, generator=gen, dtype=dtype) * 2 * math.pi
    angle = start + torch.linspace(0, math.pi, seq_len, dtype=dtype)
    pts = torch.stack([angle.cos(), angle.sin()], -1)
    return pts + 0.05 * torch.randn(pts.shape, generator=gen, dtype=dtype)


def meanflow_loss(model: nn.Module, x, gen: torch.Generator, stop_gradient: bool = False):
    """One MeanFlow-style loss on data ``x`` (B, N, 2); returns (loss, d/dt u)."""
    b = x.shape[0]
    eps = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    t, r = torch.rand(2, b, generator=gen, dtype=x.dtype).sort(0, descending=True).values
    z = (1 - t)[:, None, None] * x + t[:, None, None] * eps
    v = eps - x
    # u and its total time derivative along the path: one jvp through the whole network
    u, du_dt = torch.func.jvp(model, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    gap = (t - r)[:, None, None]
    if stop_gradient:
        target = (v - gap * du_dt).detach()
        return F.mse_loss(u, target), du_dt
    return (u + gap * du_dt - v).square().mean(), du_dt


def gradient_check(seed: int = 0) -> float:
    """Max |difference| of one step's parameter gradients, ttt_flash vs materialised
    attention, float64 (the backward goes through the jvp of every attention layer)."""
    grads = {}
    for attention in ("ttt_flash", "math"):
        torch.manual_seed(seed)
        model = FlowTransformer(attention=attention).double()
        gen = torch.Generator().manual_seed(seed)
        x = make_batch(gen, 3, 8, torch.float64)
        loss, _ = meanflow_loss(model, x, gen)
        grads[attention] = torch.autograd.grad(loss, list(model.parameters()))
    return max((a - b).abs().max().item() for a, b in zip(grads["ttt_flash"], grads["math"]))


def main(steps: int = 30, batch: int = 16, seq_len: int = 16, stop_gradient: bool = False, seed: int = 0,
         verbose: bool = True) -> dict:
    torch.manual_seed(seed)
    model = FlowTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        x = make_batch(gen, batch, seq_len)
        loss, _ = meanflow_loss(model, x, gen, stop_gradient)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if verbose and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}")
    diff = gradient_check(seed)
    if verbose:
        print(f"gradients through the jvp, ttt_flash vs materialised attention (float64): max |diff| {diff:.2e}")
    return {"losses": losses, "gradient_difference": diff}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--stop-gradient", action="store_true", help="MeanFlow's stop-gradient target")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.steps, a.batch, a.seq_len, a.stop_gradient, a.seed)
