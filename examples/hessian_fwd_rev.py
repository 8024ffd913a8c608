"""Forward-over-reverse Hessians of a small attention model with torch.func.hessian.

``torch.func.hessian(f)`` is ``jacfwd(jacrev(f))``: forward mode over reverse mode. Through
:func:`ttt_flash.flash_attention` the inner reverse pass is the first backward and the outer
forward pass its jvp (the first backward with dO = dȮ plus the backward-over-backward with
U = ẋ), so the Hessian is exact. This script

1. takes the full Hessian of a one-layer attention model's loss with respect to its query,
   key and value projections (``torch.func.functional_call``), compares it with the same
   model on materialised attention and prints its extreme eigenvalues;
2. computes one Hessian-vector product of the same loss with
   :func:`ttt_flash.second_order.hvp` in both modes (``"fwd_rev"``: no ``create_graph`` graph,
   and ``"rev_rev"``) and compares them with the Hessian.

Run (CPU, seconds)::

    python examples/hessian_fwd_rev.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.func import functional_call, hessian

from ttt_flash import flash_attention
from ttt_flash.second_order import hvp
from ttt_flash.attention.reference import naive_attention


class TinyAttention(nn.Module):
    """One causal attention layer with a linear read-out: (B, N, dim) -> (B, N, dim)."""

    def __init__(self, dim: int = 4, heads: int = 2, attention: str = "ttt_flash"):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape

        def split(t):
            return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

        attn = flash_attention if self.attention == "ttt_flash" else naive_attention
        o = attn(split(self.q(x)), split(self.k(x)), split(self.v(x)), causal=True)
        return self.out(o.transpose(1, 2).reshape(b, n, c))


def main(dim: int = 4, seq_len: int = 6, batch: int = 2, seed: int = 0, verbose: bool = True) -> dict:
    names = ["q.weight", "k.weight", "v.weight"]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, dim, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, seq_len, dim, generator=gen, dtype=torch.float64)
    result = {}
    flat = {}
    for attention in ("ttt_flash", "math"):
        torch.manual_seed(seed)
        model = TinyAttention(dim, attention=attention).double()
        params = {n: p.detach() for n, p in model.named_parameters() if n in names}

        def loss(p):
            return (functional_call(model, p, (x,)) - y).square().mean()

        h = hessian(loss)(params)  # jacfwd(jacrev(loss)): forward over reverse
        flat[attention] = torch.cat([torch.cat([h[a][b].reshape(params[a].numel(), -1) for b in names], 1)
                                     for a in names], 0)
        if attention == "ttt_flash":
            ours_model, ours_params = model, params
    h = flat["ttt_flash"]
    result["hessian_difference_to_math"] = (h - flat["math"]).abs().max().item()
    result["symmetry_error"] = (h - h.T).abs().max().item()
    eig = torch.linalg.eigvalsh((h + h.T) / 2)
    result["eigenvalues"] = (eig[0].item(), eig[-1].item())

    # one HVP by forward over reverse and by reverse over reverse (ttt_flash.second_order)
    selected = {n: p for n, p in ours_model.named_parameters() if n in names}
    chosen = {id(p) for p in selected.values()}
    for p in ours_model.parameters():
        p.requires_grad_(id(p) in chosen)
    vec = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in selected.values()]
    closure = lambda: (ours_model(x) - y).square().mean()  # noqa: E731
    fr = hvp(closure, selected, vec, mode="fwd_rev", module=ours_model)
    rr = hvp(closure, selected, vec)
    expect = h @ torch.cat([v.reshape(-1) for v in vec])
    result["hvp_fwd_rev_vs_hessian"] = (torch.cat([a.reshape(-1) for a in fr]) - expect).abs().max().item()
    result["hvp_rev_rev_vs_hessian"] = (torch.cat([a.reshape(-1) for a in rr]) - expect).abs().max().item()
    if verbose:
        print(f"Hessian of the loss w.r.t. W_q, W_k, W_v: {tuple(h.shape)}")
        print(f"  max |ttt_flash - materialised attention| = {result['hessian_difference_to_math']:.2e}")
        print(f"  max |H - Hᵀ| = {result['symmetry_error']:.2e}")
        print(f"  eigenvalues in [{eig[0].item():.4f}, {eig[-1].item():.4f}]")
        print(f"HVP fwd_rev vs H v: {result['hvp_fwd_rev_vs_hessian']:.2e}; "
              f"rev_rev vs H v: {result['hvp_rev_rev_vs_hessian']:.2e}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.dim, a.seq_len, a.batch, a.seed)
