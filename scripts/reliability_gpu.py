"""GPU checks of the reliability guarantees (docs/reliability.md) that CI runs on the CPU:

1. ``ttt-flash fit`` under DDP on N GPUs (NCCL), started from a temporary folder outside the
   repository, finishes (status 0, no rank left behind);
2. a DDP run on N GPUs stopped mid-epoch and resumed with ``--ckpt_path last`` ends with the
   weights and optimizer state of the uninterrupted run (largest difference; 0 is bitwise).

Usage: python scripts/reliability_gpu.py OUT_DIR [--devices 2]. Prints a table last and
writes OUT_DIR/reliability_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "maml_sinusoid.yaml"


def _exe() -> str:
    beside = Path(sys.executable).parent / "ttt-flash"
    return str(beside) if beside.is_file() else (shutil.which("ttt-flash") or "ttt-flash")


def _run(args, cwd, timeout=540):
    start = time.perf_counter()
    p = subprocess.Popen([_exe(), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = "timeout"
    return rc, time.perf_counter() - start, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for reliability_gpu.json")
    ap.add_argument("--devices", type=int, default=2, help="GPUs (DDP processes)")
    a = ap.parse_args(argv)
    if a.devices < 1:
        ap.error(f"--devices must be >= 1, got {a.devices}")
    if torch.cuda.device_count() < a.devices:
        ap.error(f"--devices {a.devices}: this machine has {torch.cuda.device_count()} GPUs")
    os.makedirs(a.out, exist_ok=True)
    ddp = ["--trainer.accelerator=gpu", f"--trainer.devices={a.devices}", "--trainer.strategy=ddp",
           "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rc, secs, out = _run(["fit", "--config", str(RECIPE), "--trainer.fast_dev_run=true", *ddp], tmp)
        rows.append({"check": f"fit under DDP ({a.devices} GPUs) from another folder", "ok": rc == 0,
                     "detail": f"status {rc}", "seconds": round(secs, 1), "tail": out[-2000:] if rc != 0 else ""})
    with tempfile.TemporaryDirectory() as tmp:
        tiny = ["fit", "--config", str(RECIPE), "--data.init_args.train_batches=8",
                "--data.init_args.meta_batch_size=4", "--data.init_args.val_batches=1", "--trainer.max_epochs=3",
                "--trainer.log_every_n_steps=1", *ddp]
        last = Path(tmp) / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt"
        start = time.perf_counter()
        statuses = []
        rc, _, out = _run([*tiny, "--trainer.max_steps=12"], tmp)
        statuses.append(rc)
        straight = torch.load(last, weights_only=True) if rc == 0 else None
        shutil.rmtree(Path(tmp) / "runs", ignore_errors=True)
        for extra in (["--trainer.max_steps=6"], ["--trainer.max_steps=12", "--ckpt_path", "last"]):
            rc, _, out2 = _run([*tiny, *extra], tmp)
            statuses.append(rc)
            out += out2
        ok, detail = False, f"statuses {statuses}"
        if all(s == 0 for s in statuses) and straight is not None:
            resumed = torch.load(last, weights_only=True)
            diff = max((straight["state_dict"][n].float() - resumed["state_dict"][n].float()).abs().max().item()
                       for n in straight["state_dict"])
            ok = diff == 0 and straight["global_step"] == resumed["global_step"] == 12
            detail = f"max weight difference {diff:.3g} at step {resumed['global_step']}"
        rows.append({"check": f"DDP resume mid-epoch ({a.devices} GPUs), bitwise", "ok": ok, "detail": detail,
                     "seconds": round(time.perf_counter() - start, 1), "tail": "" if ok else out[-2000:]})
    result = {"devices": a.devices, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    with open(os.path.join(a.out, "reliability_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        if r["tail"]:
            print(r["tail"])
    print(f"{'check':<55} {'ok':>4} {'seconds':>8}  detail")
    for r in rows:
        print(f"{r['check']:<55} {str(r['ok']):>4} {r['seconds']:>8}  {r['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
