"""The ``ttt-flash`` command.

Subcommands:

* ``ttt-flash check``: a small end-to-end job: an exact Hessian-vector product through
  attention on random data, compared with autograd applied twice to materialised
  attention in float64. Exits non-zero if any output disagrees.
* ``ttt-flash fit|validate|test --config recipes/NAME.yaml``: LightningCLI over any
  LightningModule / LightningDataModule named by ``class_path`` in the recipe (CSV logs
  and checkpoints under ``runs/`` by default; ``--print_config`` shows the full config;
  ``--smoke`` tries the recipe on the CPU in seconds; ``--help`` is short, ``--help-all`` lists
  every option).
* ``ttt-flash --version`` / ``--help``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

from . import __version__

_COMMANDS = {
    "check": "exact attention Hessian-vector product vs a float64 materialised oracle",
    "bench": "time the attention chain (fwd, bwd, backward-over-backward) against peers",
    "fit": "train a recipe (LightningCLI): ttt-flash fit --config recipes/NAME.yaml [--smoke: a CPU try in seconds]",
    "validate": "validate a recipe (LightningCLI)",
    "test": "test a recipe (LightningCLI)",
}

_LIGHTNING_COMMANDS = ("fit", "validate", "test")


_FIT_HELP = """\
usage: ttt-flash {command} --config RECIPE.yaml [--smoke] [--KEY=VALUE ...]

{what} a recipe (a YAML file naming a LightningModule, a LightningDataModule and Trainer
settings; the shipped ones are in recipes/) with LightningCLI.

  -c, --config RECIPE.yaml   the recipe (several: later files override earlier ones)
  --smoke                    try the recipe on the CPU in seconds: 2 steps at tiny sizes, no
                             checkpoints, logs in runs/smoke-NAME/
  --KEY=VALUE                override any recipe key, e.g. --trainer.max_steps=100,
                             --model.init_args.inner_lr=0.05, --trainer.accelerator=cpu
  --ckpt_path last|FILE      resume from runs/NAME/checkpoints/last.ckpt (or a file)
  --seed_everything N        the seed of the weights (data seeds are data.init_args.seed)
  --tensorboard true         also log to TensorBoard, beside the CSV log
  --print_config             print the full resolved config (every key and default) and exit
  --model.help CLASS         the options of a model class (also --data.help CLASS)
  --help-all                 every option (about 500 lines: LightningCLI's full help)

Logs, config.yaml, checkpoints and val_curves.png (pip install -e ".[plot]") go to
runs/NAME/; the last line of a run names them.
"""


#: Set while a ``--smoke`` run runs, for the processes Lightning's DDP launcher starts.
SMOKE_RUN_ENV = "TTT_FLASH_SMOKE_RUN"


def _short_help(command: str) -> str:
    what = {"fit": "Train", "validate": "Validate", "test": "Test"}[command]
    return _FIT_HELP.format(command=command, what=what)


def _lightning(argv: Sequence[str]) -> int:
    """LightningCLI with subclass mode: a recipe names its module and data by class_path.

    A run stopped by SIGTERM / SIGINT (after writing ``last.ckpt``, see
    :mod:`ttt_flash.lightning.resume`) exits with status 128 + signal: 143 / 130."""
    argv = list(argv)
    prog = f"ttt-flash {argv[0]}"
    rest = argv[1:]
    if ("-h" in rest or "--help" in rest) and not any(a.endswith(".help") for a in rest):
        print(_short_help(argv[0]), end="")
        return 0
    argv = [("--help" if a == "--help-all" else a) for a in argv]
    from ._cli_errors import config_files, config_file_error

    files = config_files(argv)
    for path in files:
        message = config_file_error(path, prog)
        if message:
            sys.stderr.write(message + "\n")
            return 2
    smoke = "--smoke" in argv
    # a process Lightning's DDP launcher started for a smoke run: its command line is the
    # parent's sys.argv, which holds the smoke overrides already but not --smoke itself
    smoke_rank = not smoke and os.environ.get(SMOKE_RUN_ENV) == "1" and "LOCAL_RANK" in os.environ
    if smoke:
        from ._smoke import insert_after_configs, smoke_overrides

        argv = [a for a in argv if a != "--smoke"]
        if not files:
            sys.stderr.write(f"{prog}: error: --smoke needs a recipe: --config recipes/NAME.yaml --smoke\n")
            return 2
        argv = insert_after_configs(argv, smoke_overrides(files))

    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ._recipe_cli import LAST_RUN, SETTINGS_LISTED, recipe_cli, run_report
    from .lightning.checkpoint_io import CheckpointWriteError
    from .lightning.resume import check_ckpt_path, interrupt_exit_code

    check_ckpt_path(argv)
    SETTINGS_LISTED.clear()
    LAST_RUN.clear()
    saved_env = os.environ.get(SMOKE_RUN_ENV)
    if smoke:  # every rank of a smoke run under DDP runs it as a smoke run (same callbacks)
        os.environ[SMOKE_RUN_ENV] = "1"
    try:
        # LightningCLI on sys.argv = [<ttt-flash script path>, *argv], quiet, short unknown-key errors, CPU threads
        _run_cli(recipe_cli(argv, smoke=smoke or smoke_rank), LightningModule, LightningDataModule)
    except SIGTERMException:
        code = interrupt_exit_code()
        _report(run_report(stopped="SIGINT" if code == 130 else "SIGTERM"))
        return code
    except CheckpointWriteError as e:  # e.g. a full disk: which file, and what was kept
        raise SystemExit(f"ttt-flash: error: {e}") from None
    except RuntimeError as e:
        if "Error(s) in loading state_dict" not in str(e):
            raise
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        why = "the settings that differ are listed above" if SETTINGS_LISTED else "was the model changed?"
        raise SystemExit(f"ttt-flash: error: the checkpoint's weights do not fit this run's model ({why}):\n  "
                         + "\n  ".join(lines[:3])
                         + (f"\n  ... {len(lines) - 3} more" if len(lines) > 3 else "")) from None
    finally:
        if saved_env is None:
            os.environ.pop(SMOKE_RUN_ENV, None)
        else:
            os.environ[SMOKE_RUN_ENV] = saved_env
    _report(run_report())
    return 0


def _report(line: Optional[str]) -> None:
    if line:
        print(line, flush=True)


def _run_cli(LightningCLI, LightningModule, LightningDataModule) -> None:
    from .lightning.checkpoint_io import SaveConfigOnStart

    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=SaveConfigOnStart,  # config.yaml once the run has started (not by a failed run)
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": "runs"},
            },
            "default_root_dir": "runs",
        },
        auto_configure_optimizers=False,
    )


def _check(argv: Sequence[str]) -> int:
    import torch

    from .attention import flash_attention
    from .bench.common import attention_chain
    from .attention.reference import naive_attention

    p = argparse.ArgumentParser(prog="ttt-flash check", description=_COMMANDS["check"])
    p.add_argument("--batch", type=int, default=2, help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="query heads H (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads; must divide --heads (grouped-query attention; default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length N (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension d (default: %(default)s)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal mask (--no-causal: every query sees every key; default: causal)")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window: each query sees its W most recent keys (needs --causal; default: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to run on (default: cuda when available, else cpu; here %(default)s)")
    p.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"], default=None,
                   help="input dtype (default: float64 on the CPU, float32 with --backend triton there, under "
                        "the Triton interpreter; bfloat16 on CUDA)")
    p.add_argument("--backend", choices=["auto", "triton", "reference"], default="auto",
                   help="ttt_flash backend compared with the reference: auto picks triton on CUDA, the PyTorch "
                        "reference elsewhere (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    a = p.parse_args(argv)
    for flag in ("batch", "heads", "kv_heads", "seq_len", "head_dim"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)} (nothing to compare)")
    if a.heads % a.kv_heads:
        p.error(f"--heads ({a.heads}) must be a multiple of --kv-heads ({a.kv_heads}) (grouped-query attention)")
    if a.window is not None and a.window < 1:
        p.error(f"--window must be >= 1 (the number of most recent keys a query sees), got {a.window}")
    if a.window is not None and not a.causal:
        p.error("--window needs --causal (a sliding window looks back from each query)")
    on_cuda = a.device.startswith("cuda")
    if a.backend == "triton" and not on_cuda:
        # Without CUDA the Triton kernels run only under the Triton interpreter, in float32
        # (its bfloat16/float16 dots give wrong numbers; float64 is not a kernel dtype).
        if a.dtype not in (None, "float32"):
            p.error(f"--backend triton on {a.device} runs the kernels under the Triton interpreter in "
                    f"float32 only, got --dtype {a.dtype}: drop --dtype, or use --backend reference")
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            # The interpreter is chosen when triton first compiles the kernels: rerun this
            # check in a fresh process with it switched on.
            cmd = [sys.executable, "-m", "ttt_flash.cli", "check", *argv]
            return subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}).returncode
        a.dtype = "float32"
    dtype_name = a.dtype or ("bfloat16" if on_cuda else "float64")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(a.seed)

    def rand(h, n):
        return torch.randn(a.batch, h, n, a.head_dim, device=a.device, dtype=torch.float64)

    exact_inputs = [rand(a.heads, a.seq_len), rand(a.kv_heads, a.seq_len), rand(a.kv_heads, a.seq_len)]
    do = rand(a.heads, a.seq_len)
    vecs = [torch.randn_like(x) for x in exact_inputs]

    def chain(attn, cast):
        q, k, v = (x.to(cast).requires_grad_(True) for x in exact_inputs)
        dov = do.to(cast).requires_grad_(True)
        return attention_chain(attn, q, k, v, dov, [w.to(cast) for w in vecs])

    kw = dict(causal=a.causal, window=a.window)
    t0 = time.perf_counter()
    ours = chain(lambda q, k, v: flash_attention(q, k, v, backend=a.backend, layout="bhnd", **kw), dtype)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    exact = chain(lambda q, k, v: naive_attention(q, k, v, **kw), torch.float64)
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}[dtype_name]
    names = ["o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar"]
    print(f"ttt-flash {__version__} check: B={a.batch} H={a.heads}/{a.kv_heads} N={a.seq_len} "
          f"D={a.head_dim} causal={a.causal} window={a.window} {dtype_name} on {a.device}, "
          f"backend={a.backend}{_resolved(a.backend, ours[0])}")
    print(f"{'output':>8}  {'rel. L2 error vs float64':>24}")
    ok = True
    for name, x, e in zip(names, ours, exact):
        err = ((x.double() - e).norm() / e.norm().clamp_min(1e-30)).item()
        ok &= err <= tol
        print(f"{name:>8}  {err:24.3e}")
    print(f"chain (forward, backward, backward-over-backward): {elapsed * 1e3:.1f} ms (first call)")
    print("OK" if ok else f"FAILED: an error exceeds {tol:g}")
    return 0 if ok else 1


def _resolved(backend: str, o) -> str:
    """For backend="auto", the suffix naming what ran (" (triton)" / " (reference)"); else ""."""
    from .attention import resolve_backend

    return f" ({resolve_backend(backend, o)})" if backend == "auto" else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ttt-flash`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    epilog = "commands:\n" + "\n".join(f"  {k:<10} {v}" for k, v in _COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="ttt-flash",
        description="Exact double backward through softmax attention (FlashBoB) for "
        "test-time training and meta-learning.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ttt-flash {__version__}")
    p.add_argument("command", nargs="?", choices=sorted(_COMMANDS), help="see below")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    if not argv:
        p.print_help()
        return 0
    if argv[0] in _LIGHTNING_COMMANDS:
        return _lightning(argv)
    if argv[0] in _COMMANDS:
        if argv[0] == "bench":
            from .bench import main as bench_main

            return bench_main(argv[1:])
        return {"check": _check}[argv[0]](argv[1:])
    p.parse_args(argv)  # --version / --help / an unknown command (argparse reports it)
    return 0


if __name__ == "__main__":
    sys.exit(main())
