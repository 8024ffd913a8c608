"""Context parallelism misused across the ranks of a group (2 processes, gloo): every rank
gets the same clear ValueError instead of a wrong result, an abort or a hang."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ttt_flash.distributed import context_parallel_attention, context_parallel_attention_varlen

F64 = torch.float64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(rank):
    x = torch.randn(1, 2, 3, 8, dtype=F64)
    d4 = torch.randn(1, 2, 3, 4 if rank else 8, dtype=F64)
    only_rank0 = dist.new_group([0])  # every rank creates every group
    t = torch.randn(3, 2, 8, dtype=F64)
    cu = torch.tensor([0, 2, 6] if rank else [0, 3, 6], dtype=torch.int32)
    return {
        "causal": lambda: context_parallel_attention(x, x, x, causal=bool(rank)),
        "head_dim": lambda: context_parallel_attention(d4, d4, d4),
        "seq_len": lambda: context_parallel_attention(x, x, x, seq_len=6 + rank),  # wrong on rank 1 only
        "seq_len_both": lambda: context_parallel_attention(x, x, x, seq_len=7),
        "window": lambda: context_parallel_attention(x, x, x, causal=True, window=None if rank else 2),
        "varlen_cu_seqlens": lambda: context_parallel_attention_varlen(t, t, t, cu),
        "group": lambda: context_parallel_attention(x, x, x, group=only_rank0) if rank else None,
        "fine": lambda: context_parallel_attention(x, x, x, causal=True, seq_len=6),  # the group still works
    }


def _worker(rank, size, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    out = {}
    try:
        for name, call in _cases(rank).items():
            try:
                call()
                out[name] = "ok"
            except ValueError as e:
                out[name] = str(e)
        torch.save(out, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cp_misuse"))
    ctx = mp.start_processes(_worker, args=(2, _free_port(), path), nprocs=2, start_method="fork", join=False)
    import time

    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("a misuse case hung")
    return [torch.load(os.path.join(path, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("case,words", [
    ("causal", ["causal", "rank 0: False", "rank 1: True"]),
    ("head_dim", ["q shape", "(1, 2, 8)", "(1, 2, 4)"]),
    ("seq_len", ["seq_len", "rank 0: 6", "rank 1: 7"]),
    ("seq_len_both", ["seq_len=7", "[3, 3]", "[3, 4]"]),
    ("window", ["window", "rank 0: 2", "rank 1: None"]),
    ("varlen_cu_seqlens", ["cu_seqlens"]),
])
def test_every_rank_gets_the_same_error(messages, case, words):
    first, second = messages[0][case], messages[1][case]
    assert first == second != "ok"
    for w in words:
        assert w in first, first


def test_a_group_without_this_rank_is_named(messages):
    assert messages[0]["group"] == "ok"
    assert "not a member of the process group" in messages[1]["group"] and "global rank 1" in messages[1]["group"]


def test_the_group_works_after_the_errors(messages):
    assert messages[0]["fine"] == messages[1]["fine"] == "ok"
