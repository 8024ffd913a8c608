"""The benchmarks behind ``ttt-flash bench`` (docs/benchmarks.md).

Modules:

* :mod:`ttt_flash.bench.chain`: the attention chain (forward, first backward with
  ``create_graph=True``, backward-over-backward), the ``ttt-flash bench`` entry; its ``main``
  dispatches to the others.
* :mod:`ttt_flash.bench.step`: a GPT training step, eager vs ``torch.compile`` (``--gpt-step``).
* :mod:`ttt_flash.bench.jvp`: forward-mode AD through attention (``--jvp``).
* :mod:`ttt_flash.bench.cp`: one sequence across P processes (``--context-parallel P``).
* :mod:`ttt_flash.bench.graph`: eager against CUDA-graph replay (``--graph``).
* :mod:`ttt_flash.bench.common`: what they share (timing, one measured row, the JSON file,
  the attention chain that ``ttt-flash check`` runs too).

The chain benchmark's names are re-exported here, so ``from ttt_flash.bench import main`` and
``python -m ttt_flash.bench ...`` work as ``ttt-flash bench ...`` does.
"""

from .chain import (
    BenchConfig, build_parser, chain_flops, check_args, format_table, main, make_provider, plot_panels, run_bench, save,
)
from .common import flop_unit

__all__ = ["BenchConfig", "build_parser", "chain_flops", "check_args", "flop_unit", "format_table", "main",
           "make_provider", "plot_panels", "run_bench", "save"]
