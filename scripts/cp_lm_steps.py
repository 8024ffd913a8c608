"""Sophia-H training steps of the GPT-2-small-shape byte GPT on one long sequence per step, on
one GPU or context parallel across P GPUs (``LanguageModel(context_parallel=P)`` under DDP).

The settings of ``recipes/sophia_gpt.yaml`` (bf16 autocast, Sophia-H with a Hessian refresh
every 10 steps, gradient clipping 1.0) with ``seq_len`` tokens per window and one window per
step, through a plain ``lightning.pytorch.Trainer`` (no LightningCLI, hence no jsonargparse).
Rank 0 prints every step's logged metrics; a ``step i`` line shows ``train/step_time_s``,
``train/hessian_refresh_s`` and ``train/peak_mem_gib`` of step i − 1 (the module logs them
after the callback prints).

    python scripts/cp_lm_steps.py --seq-len 32768 --devices 1
    python scripts/cp_lm_steps.py --seq-len 32768 --devices 2 --context-parallel 2

The same through the recipe (where jsonargparse is installed)::

    ttt-flash fit --config recipes/sophia_gpt.yaml --data.init_args.seq_len=32768 \\
        --data.init_args.batch_size=1 --trainer.devices=2 --trainer.strategy=ddp \\
        --model.init_args.context_parallel=2
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

from ttt_flash.lightning import ByteTextDataModule, LanguageModel
from ttt_flash.models import GPTConfig


class _Print(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            shown = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
            print("step", batch_idx, shown, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--context-parallel", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    pl.seed_everything(0)
    model = LanguageModel(GPTConfig.gpt2_small(vocab_size=256), optimizer="sophiah", lr=3e-4, betas=(0.965, 0.99),
                          weight_decay=0.2, hessian_every=10, warmup_steps=200, context_parallel=a.context_parallel)
    data = ByteTextDataModule(seq_len=a.seq_len, batch_size=1, num_workers=2)
    trainer = pl.Trainer(accelerator="gpu", devices=a.devices, strategy="ddp" if a.devices > 1 else "auto",
                         precision="bf16-mixed", max_steps=a.steps, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         callbacks=[_Print()])
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
