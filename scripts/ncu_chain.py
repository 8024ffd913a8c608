"""One chain at N=16,384 (B=1, H=12, d=64, bf16, non-causal) after a warm-up: the program
``ncu`` profiles (stall reasons, occupancy of each kernel):

    ncu --clock-control none --launch-skip 7 --launch-count 7 --kernel-name regex:_kernel \
        --section WarpStateStats --section Occupancy --section SpeedOfLight python3 scripts/ncu_chain.py
"""
import torch

from ttt_flash import flash_attention

x = [torch.randn(1, 12, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
q, k, v, do = (t.requires_grad_(True) for t in x[:4])
for _ in range(2):
    o = flash_attention(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * b).sum() for a, b in zip(g, x[4:]))
    torch.autograd.grad(inner, (q, k, v, do))
torch.cuda.synchronize()
