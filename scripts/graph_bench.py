"""Every number of the CUDA-graph benchmark (docs/cuda-graphs.md, docs/benchmarks.md) in one run:
the chain eager / host / kernel / replayed / first-order SDPA flash at 1K and 4K (causal and
not) and B=8 2K causal; the MAML meta-step at N = 512 and 2,048 (ttt-flash eager and replayed,
the same loop with SDPA math, higher + SDPA math); recipes/maml_transformer.yaml with
cuda_graph false / true; a GPT-2-small step and Hessian-vector-product step at batch 1 / 1,024
and batch 8 / 2,048, eager and replayed.

    python3 scripts/graph_bench.py OUT_DIR [extra ttt-flash bench --graph options]

Writes OUT_DIR/bench_graph.json and prints a table last.
"""
import sys

from ttt_flash.bench_graph import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    raise SystemExit(main(["--out", sys.argv[1], *sys.argv[2:]]))
