"""Training-run evidence on the GPU machine: recipes run in parallel queues, one per GPU.

    python scripts/gpu_runs.py --plan probe --out $OUT        # #5 runs, math OOM checks, short #6 runs
    python scripts/gpu_runs.py --plan ddp,long --out $OUT     # DDP on 2 GPUs, then the 50-step #6 runs
    python scripts/gpu_runs.py --plan ddp_more,ddp_more2 --out $OUT  # MAML and Sophia-H: 1 GPU, then DDP on 2

Each job is ``ttt-flash fit --config RECIPE ...`` in its own process with its own CSV log
folder (runs/gpu/<job>/), a wall-clock limit, and CUDA_VISIBLE_DEVICES set to its queue's
GPU(s). After the jobs, each log's metrics.csv is summarised: steps logged, median
train/step_time_s over the steps after the first two (compilation and autotuning warm-up
excluded), median train/tokens_per_s, max train/peak_mem_gib, and whether the process ran
out of memory. Prints a table last; writes runs.json and the job logs to --out.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time

LOG = ["--trainer.logger.init_args.flush_logs_every_n_steps=1"]
MAML = "recipes/maml_transformer_long.yaml"
GRADMEM = "recipes/gradmem_kv_long.yaml"
TTT = "recipes/ttt_e2e_mqar_long.yaml"
SOPHIA = "recipes/sophia_gpt.yaml"


def plans(steps_long: int):
    """{plan: [queue, ...]}; a queue is (gpus, [(job, recipe, extra args, limit_s), ...])."""
    maml = ["--trainer.max_steps=10", "--trainer.limit_val_batches=0"]
    sophia = ["--trainer.max_steps=40", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1"]
    ddp = ["--trainer.devices=2", "--trainer.strategy=ddp"]
    probe = {
        "probe": [
            ("0", [
                ("maml_second_order", MAML, maml, 200),
                ("maml_first_order", MAML, maml + ["--model.init_args.first_order=true"], 120),
                ("maml_math", MAML, maml + ["--model.init_args.net.attention=math"], 90),
                ("gradmem_math", GRADMEM, ["--trainer.max_steps=2", "--model.init_args.net.init_args.model.attention=math"], 90),
                ("ttt_e2e_math", TTT, ["--trainer.max_steps=2", "--model.init_args.net.init_args.model.attention=math"], 120),
            ]),
            ("1", [
                ("gradmem_probe", GRADMEM, ["--trainer.max_steps=6"], 200),
                ("ttt_e2e_probe", TTT, ["--trainer.max_steps=6"], 200),
                ("compile_tests", None, ["python", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                         "tests/test_compile_gpu.py"], 300),
                ("bench_gpt_step", None, ["python", "-m", "ttt_flash.bench", "--gpt-step", "--seq-lens",
                                          "4096,16384", "--layers", "4", "--out", "runs/gpu/bench_step"], 300),
            ]),
        ],
        "long": [
            ("0", [("gradmem_50", GRADMEM, [f"--trainer.max_steps={steps_long}"], 420)]),
            ("1", [("ttt_e2e_50", TTT, [f"--trainer.max_steps={steps_long}"], 300),
                   ("compile_tests", None, ["python", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                            "tests/test_compile_gpu.py"], 200)]),
        ],
        "ddp_more": [  # one-GPU baselines side by side, then the same recipes on both GPUs
            ("0", [("sophia_1gpu", SOPHIA, sophia, 240)]),
            ("1", [("maml_1gpu", MAML, maml, 200)]),
        ],
        "ddp_more2": [
            ("0,1", [("maml_ddp2", MAML, maml + ddp, 240), ("sophia_ddp2", SOPHIA, sophia + ddp, 240)]),
        ],
        "ddp_maml": [("0,1", [("maml_ddp2", MAML, maml + ddp, 240)])],
        "cpu": [  # a smoke test of this script on the CPU recipes
            ("", [("gradmem_cpu", "recipes/gradmem_kv.yaml", ["--trainer.max_steps=4", "--trainer.log_every_n_steps=1"], 300)]),
        ],
        "ddp": [
            ("0,1", [("gradmem_ddp2", GRADMEM, ["--trainer.max_steps=10", "--trainer.devices=2",
                                                 "--trainer.strategy=ddp"], 300)]),
        ],
    }
    return probe


def run_job(job, recipe, extra, limit, gpus, out):
    name = job
    logdir = os.path.join("runs", "gpu", name)
    if recipe is None:  # a plain command
        cmd = [sys.executable if c == "python" else c for c in extra]
    else:
        cmd = [sys.executable, "-m", "ttt_flash.cli", "fit", "--config", recipe, *extra, *LOG,
               f"--trainer.logger.init_args.save_dir={logdir}"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    text = open(os.path.join(out, f"{name}.log")).read()
    row = {"job": name, "recipe": recipe, "extra": extra, "gpus": gpus, "rc": rc, "wall_s": round(wall, 1),
           "oom": "OutOfMemoryError" in text or "out of memory" in text.lower()}
    files = sorted(glob.glob(os.path.join(logdir, "lightning_logs", "version_*", "metrics.csv")))
    if files:
        with open(files[-1]) as f:
            rows = list(csv.DictReader(f))

        def col(key):
            return [float(r[key]) for r in rows if r.get(key) not in (None, "")]

        st = col("train/step_time_s")
        row["steps"] = len(st)
        if st:
            steady = st[2:] or st
            row["step_time_s"] = statistics.median(steady)
            row["step_time_first_s"] = st[0]
            row["step_time_mean_s"] = statistics.fmean(steady)
        tps = col("train/tokens_per_s")
        if tps:
            row["tokens_per_s"] = statistics.median(tps[2:] or tps)
        mem = col("train/peak_mem_gib")
        if mem:
            row["peak_mem_gib"] = max(mem)
        for key in ("train/loss_pre", "train/loss_post", "train/acc_pre", "train/acc_post"):
            vals = col(key)
            if vals:
                row[key] = [round(vals[0], 4), round(vals[-1], 4)]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(row)}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="probe", help="comma-separated: probe, long, ddp (run in order)")
    p.add_argument("--out", default="gpu_runs_out")
    p.add_argument("--steps-long", type=int, default=50)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = []
    for plan in a.plan.split(","):
        queues = plans(a.steps_long)[plan]
        lock = threading.Lock()

        def worker(gpus, jobs):
            for job in jobs:
                r = run_job(*job, gpus=gpus, out=a.out)
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=worker, args=q) for q in queues]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with open(os.path.join(a.out, "runs.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'job':<20}{'rc':>8}{'wall s':>8}{'steps':>6}{'step s':>9}{'1st s':>8}{'tok/s':>10}{'GiB':>7}{'OOM':>5}")
    for r in results:
        print(f"{r['job']:<20}{str(r['rc']):>8}{r['wall_s']:>8.0f}{r.get('steps', 0):>6}"
              f"{r.get('step_time_s', float('nan')):>9.2f}{r.get('step_time_first_s', float('nan')):>8.1f}"
              f"{r.get('tokens_per_s', float('nan')):>10.0f}{r.get('peak_mem_gib', float('nan')):>7.1f}"
              f"{'yes' if r['oom'] else 'no':>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
