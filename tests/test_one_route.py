"""One route per call: eager calls (the autograd Functions) and calls traced by torch.compile
(the custom operators) pass the same argument checks (ttt_flash/attention/checks.py) and run
the composers of the same table (ttt_flash/attention/backend.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention import backend, checks


def _dense(q, k, v):
    return flash_attention(q, k, v, causal=True)


def _varlen(q, k, v):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    return flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)


# varlen: checking cu_seqlens reads its values, a graph break under torch.compile
CALLS = [pytest.param(_dense, (1, 2, 8, 4), "check_dense", True, id="dense"),
         pytest.param(_varlen, (8, 2, 4), "check_varlen", False, id="varlen")]


def _run(fn, compiled: bool, shape, fullgraph: bool = False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="eager", fullgraph=fullgraph)
    o = fn(q, k, v)
    o.sum().backward()
    return o


class _Checked(Exception):
    pass


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fn, shape, site, fullgraph", CALLS)
def test_both_routes_pass_the_one_check_site(monkeypatch, fn, shape, site, fullgraph, compiled):
    # the check site raising stops the call on either route: nothing else validates first
    def refuse(*args, **kwargs):
        raise _Checked(site)

    monkeypatch.setattr(checks, site, refuse)
    with pytest.raises(_Checked, match=site):
        _run(fn, compiled, shape)


@pytest.mark.parametrize("fn, shape, site, fullgraph", CALLS)
def test_both_routes_read_the_one_composer_table(monkeypatch, fn, shape, site, fullgraph):
    # eagerly the autograd Functions ask the table, under torch.compile the custom operators do;
    # forward and backward alike, and nothing else picks composers
    seen = []
    real = backend.backend_module

    def spy(name):
        seen.append((sys._getframe(1).f_code.co_filename.rpartition("/")[2], name))
        return real(name)

    monkeypatch.setattr(backend, "backend_module", spy)
    eager = _run(fn, False, shape)
    assert seen and {f for f, _ in seen} == {"functions.py"} and {n for _, n in seen} == {"reference"}
    seen.clear()
    compiled = _run(fn, True, shape, fullgraph)
    assert seen and {f for f, _ in seen} == {"ops.py"} and {n for _, n in seen} == {"reference"}
    assert len(seen) == 2  # the forward operator and the backward operator
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
