"""What the long-context recipe tests share (tests/test_long_recipes.py, tests/test_131k_recipes.py):
the CPU fast_dev_run flags and each method's tiny-shape overrides, keyed by the recipe name without
its length suffix ("_long", "_131k")."""

CPU_FAST_DEV_RUN = ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.fast_dev_run=2",
                    "--trainer.enable_progress_bar=false"]
# Tiny shapes; the curriculum's second stage starts at step 1, so both stages run.
TINY_OVERRIDES = {
    "ttt_e2e_mqar": [
        "--model.init_args.attention=math",
        "--model.init_args.chunk_size=16",
        "--model.init_args.window=4",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,32],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "gradmem_kv": [
        "--model.init_args.attention=math",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,16],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "memory_layer_mqar": [
        "--model.init_args.attention=math",
        "--model.init_args.chunk_size=16",
        "--model.init_args.memory_slots=8",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,32],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "memory_layer_mqar16": [
        "--model.init_args.attention=math",
        "--model.init_args.chunk_size=16",
        "--model.init_args.memory_slots=8",
        "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,32],[1,64]]",
        "--data.init_args.batch_size=2",
    ],
    "maml_transformer": [
        "--model.init_args.net.attention=math",
        "--data.init_args.seq_len=32",
        "--data.init_args.curriculum=[[0,16],[1,32]]",
    ],
    "imaml_regression": [
        "--model.init_args.net.attention=math",
        "--data.init_args.seq_len=32",
        "--data.init_args.curriculum=[[0,16],[1,32]]",
    ],
}
