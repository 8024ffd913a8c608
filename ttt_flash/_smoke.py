"""``ttt-flash fit|validate|test --config recipes/NAME.yaml --smoke``: any recipe, tried on the CPU
in seconds.

The smoke run keeps the recipe's model and data classes and shrinks everything else: two
training steps (one validation batch), tiny shapes for the long-context and GPU recipes
(:data:`TINY`, keyed by the recipe's name without its ``_long`` / ``_131k`` suffix), CPU float32,
no CUDA graphs, no context parallelism, no data workers, and no checkpoints. It logs into
``runs/smoke-NAME/`` (emptied at the start of every smoke run). Command-line arguments given
after the recipe override the smoke settings.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

__all__ = ["TINY", "SMOKE_TRAINER", "recipe_name", "method_of", "smoke_overrides", "smoke_folder_name", "insert_after_configs"]

#: Trainer settings of every smoke run: two training steps, one validation batch at the end,
#: CPU float32 in one process, no time limit.
SMOKE_TRAINER: List[str] = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.strategy=auto",
    "--trainer.precision=32-true",
    "--trainer.max_steps=2",
    "--trainer.max_epochs=1",
    "--trainer.max_time=null",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
    "--trainer.val_check_interval=1.0",
    "--trainer.check_val_every_n_epoch=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
]

_NET = "--model.init_args.net.init_args."
_GPT = _NET + "model."  # the GPT of GradMem / FastWeightTTT
_MEMORY_LAYER = [
    _NET + "attention=math",
    _NET + "chunk_size=16",
    _NET + "memory_slots=8",
    "--data.init_args.context_len=64",
    "--data.init_args.curriculum=[[0,32],[1,64]]",
    "--data.init_args.batch_size=2",
]

#: Tiny shapes per method (the recipe name without ``_long`` / ``_131k``). A curriculum's
#: second stage starts at step 1, so both stages run in the two steps.
TINY: Dict[str, List[str]] = {
    "ttt_e2e_mqar": [
        _GPT + "attention=math",
        _NET + "chunk_size=16",
        _GPT + "window=4",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,32],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "gradmem_kv": [
        _GPT + "attention=math",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,16],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "memory_layer_mqar": _MEMORY_LAYER,
    "memory_layer_mqar16": _MEMORY_LAYER,
    "maml_transformer": [
        "--model.init_args.net.attention=math",
        "--data.init_args.seq_len=32",
        "--data.init_args.curriculum=[[0,16],[1,32]]",
    ],
    "imaml_regression": [
        "--model.init_args.net.attention=math",
        "--model.init_args.inner_steps=2",
        "--model.init_args.eval_inner_steps=2",
        "--data.init_args.seq_len=32",
        "--data.init_args.curriculum=[[0,16],[1,32]]",
    ],
    "sophia_gpt": [
        "--model.init_args.gpt.n_layer=2",
        "--model.init_args.gpt.n_head=4",
        "--model.init_args.gpt.d_model=32",
        "--model.init_args.gpt.attention=math",
        "--model.init_args.hessian_every=1",
        "--model.init_args.warmup_steps=1",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=2",
        "--data.init_args.max_bytes=65536",
    ],
}

_SUFFIXES = ("_long", "_131k", "_tiny")


def recipe_name(path: str) -> str:
    """The recipe's file name without folder and extension (``recipes/gradmem_kv_131k.yaml`` ->
    ``gradmem_kv_131k``)."""
    return os.path.splitext(os.path.basename(path))[0]


def method_of(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def smoke_folder_name(name: str) -> str:
    """The run folder (logger version) of a smoke run of recipe ``name``: ``smoke-NAME``."""
    return f"smoke-{name}"


def _recipe(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def smoke_overrides(config_files: Sequence[str]) -> List[str]:
    """The command-line overrides that make a smoke run of the recipe ``config_files[-1]``:
    :data:`SMOKE_TRAINER`, the method's :data:`TINY` shapes (when :data:`TINY` has the method;
    the small CPU recipes need none), and, where the recipe has the key, ``cuda_graph=false``,
    ``context_parallel=1``, ``num_workers=0`` and the run folder ``smoke-NAME``."""
    path = config_files[-1]
    name = recipe_name(path)
    recipe = _recipe(path)
    model = ((recipe.get("model") or {}).get("init_args") or {}) if isinstance(recipe.get("model"), dict) else {}
    data = ((recipe.get("data") or {}).get("init_args") or {}) if isinstance(recipe.get("data"), dict) else {}
    logger = (recipe.get("trainer") or {}).get("logger") if isinstance(recipe.get("trainer"), dict) else None
    out = list(SMOKE_TRAINER)
    out += TINY.get(method_of(name), [])
    if "cuda_graph" in model:
        out.append("--model.init_args.cuda_graph=false")
    if "context_parallel" in model:
        out.append("--model.init_args.context_parallel=1")
    if "num_workers" in data:
        out.append("--data.init_args.num_workers=0")
    if isinstance(logger, dict) and isinstance(logger.get("init_args"), dict):
        out.append(f"--trainer.logger.init_args.version={smoke_folder_name(name)}")
    return out


def insert_after_configs(argv: Sequence[str], extra: Sequence[str]) -> List[str]:
    """``argv`` with ``extra`` placed right after its last ``--config`` (so that arguments the
    user gave after the recipe still override ``extra``)."""
    argv = list(argv)
    last: Optional[int] = None
    for i, a in enumerate(argv):
        if a in ("-c", "--config") and i + 1 < len(argv):
            last = i + 2
        elif a.startswith("--config="):
            last = i + 1
    at = len(argv) if last is None else last
    return argv[:at] + list(extra) + argv[at:]
