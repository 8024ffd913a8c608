"""Plot the Sophia-H and AdamW runs of recipes/sophia_gpt_tiny.yaml from their results files.

    python scripts/cpu_recipe_results.py --recipe sophia_gpt_tiny --out docs/results/cpu_sophia_gpt_tiny.json
    python scripts/cpu_recipe_results.py --recipe sophia_gpt_tiny --arg=--model.init_args.optimizer=adamw \\
        --out docs/results/cpu_sophia_gpt_tiny_adamw.json
    python scripts/plot_sophia_tiny.py --out docs/sophia_tiny_cpu.png

Training loss (one batch, every logged step) and validation loss (64 fixed windows) against the
optimizer step; needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sophia", default=str(ROOT / "docs/results/cpu_sophia_gpt_tiny.json"),
                   help="results file of the Sophia-H run")
    p.add_argument("--adamw", default=str(ROOT / "docs/results/cpu_sophia_gpt_tiny_adamw.json"),
                   help="results file of the AdamW run")
    p.add_argument("--out", required=True, help="PNG file to write")
    a = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        p.error("--out: matplotlib is needed to plot; pip install 'ttt-flash[plot]'")

    fig, ax = plt.subplots(figsize=(7.7, 4.7), dpi=100)
    for path, label, color in ((a.sophia, "Sophia-H (k=10, rho=0.04)", "C0"), (a.adamw, "AdamW", "C1")):
        data = json.loads(Path(path).read_text())
        train = [(r["step"] + 1, r["train/loss"]) for r in data["train"] if "train/loss" in r]
        val = [(r["step"] + 1, r["val/loss"]) for r in data["validations"] if "val/loss" in r]
        ax.plot(*zip(*train), color=color, alpha=0.4, lw=1, label=f"{label} train (1 batch)")
        ax.plot(*zip(*val), color=color, marker="o", lw=2, label=f"{label} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("tiny byte-level GPT on CPython stdlib sources, lr 2e-3, one seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
