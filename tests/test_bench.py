"""CPU smoke test of the chain benchmark (speed is measured on the GPU, not here)."""

import json

import pytest

from ttt_flash.bench import BenchConfig, chain_flops, main


def test_bench_cpu_smoke(tmp_path, capsys):
    rc = main(["--device", "cpu", "--seq-lens", "16,32", "--heads", "2", "--head-dim", "8",
               "--causal", "--rep-ms", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ttt_flash" in out and "math" in out and "sdpa" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["check"]["ok"]
    rows = {(r["provider"], r["N"]): r for r in data["rows"]}
    assert set(rows) == {(p, n) for p in ("ttt_flash", "math", "sdpa") for n in (16, 32)}
    assert all(r["ms"] > 0 for r in rows.values())
    assert "ratio_sdpa" in rows[("ttt_flash", 32)]


def test_flop_counts_follow_bob_math():
    cfg = BenchConfig(seq_lens=[1024], heads=12, head_dim=64, device="cpu")
    assert chain_flops(cfg, 16384) == pytest.approx(52 * 64 * 12 * 16384**2)  # 1.07e13 in the issue
    assert chain_flops(cfg, 16384) == pytest.approx(1.07e13, rel=0.01)
    causal = BenchConfig(seq_lens=[8], causal=True, device="cpu")
    assert chain_flops(causal, 8) == pytest.approx(chain_flops(cfg, 8) / 12 * causal.heads / 2)
    windowed = BenchConfig(seq_lens=[8], causal=True, window=3, device="cpu")
    # 1 + 2 + 3*6 = 21 pairs
    assert chain_flops(windowed, 8) == pytest.approx(52 * windowed.head_dim * windowed.heads * 21)


def test_bad_config():
    with pytest.raises(ValueError, match="kv_heads"):
        BenchConfig(heads=12, kv_heads=5)
    with pytest.raises(ValueError, match="unknown providers"):
        BenchConfig(providers=["nope"])


def test_the_context_parallel_config_checks_the_shared_shape():
    from ttt_flash.bench.cp import CPBenchConfig

    cfg = CPBenchConfig(processes=2, heads=4, device="cpu")
    assert cfg.kv_heads == 4 and cfg.seq_lens == [262144]
    with pytest.raises(ValueError, match="window requires causal"):
        CPBenchConfig(processes=2, window=4, device="cpu")
    with pytest.raises(ValueError, match="kv_heads"):
        CPBenchConfig(processes=2, heads=12, kv_heads=5, device="cpu")


def test_a_failed_case_is_a_row_with_its_error(capsys):
    from ttt_flash.bench.graph import bench_row

    rows = []
    with bench_row({"part": "lm", "n": 8}, rows, progress=True) as row:
        row["eager_ms"] = 1.0
    with bench_row({"part": "lm", "n": 16}, rows, progress=False):
        raise RuntimeError("capture failed in aten::nonzero")
    assert rows == [{"part": "lm", "n": 8, "eager_ms": 1.0},
                    {"part": "lm", "n": 16, "error": "RuntimeError: capture failed in aten::nonzero"}]
    assert capsys.readouterr().out == "[lm] n=8  eager_ms=1.000\n"


def test_autograd_threads_switch_picks_where_every_provider_runs_its_backward(tmp_path, monkeypatch):
    import torch

    from ttt_flash.bench import chain as bench

    seen = []
    real = bench.make_provider

    def spy(cfg, provider, n):
        fn, first_order = real(cfg, provider, n)

        def run():
            seen.append(torch._C._is_multithreading_enabled())
            return fn()

        return run, first_order

    monkeypatch.setattr(bench, "make_provider", spy)
    # the default: the calling thread, as the library's second-order steps run
    rc = main(["--device", "cpu", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--providers",
               "ttt_flash", "--rep-ms", "1", "--no-check", "--out", str(tmp_path)])
    assert rc == 0 and seen and not any(seen)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["config"]["autograd_threads"] is False
    seen.clear()
    rc = main(["--device", "cpu", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--providers",
               "ttt_flash", "--rep-ms", "1", "--no-check", "--autograd-threads", "--out", str(tmp_path)])
    assert rc == 0 and seen and all(seen)
    assert json.loads((tmp_path / "bench.json").read_text())["config"]["autograd_threads"] is True


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-defaults", "cuda-defaults"])
def test_every_option_has_help_with_its_default(cuda):
    from ttt_flash.bench import build_parser

    p = build_parser(cuda=cuda)
    text = p.format_help()
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help text"
        assert "%(default)s" in p._get_formatter()._get_help_string(action), action.option_strings
    assert "(default: " + ("bfloat16" if cuda else "float64") + ")" in text
    assert "(default: " + ("1024,4096" if cuda else "64,128") + ")" in text
    assert p.parse_args([]).seq_lens == ([1024, 4096] if cuda else [64, 128])


def test_cpu_table_has_no_zero_rates_and_no_memory_column(tmp_path, capsys):
    from ttt_flash.bench import flop_unit, format_table, plot_panels

    rc = main(["--device", "cpu", "--seq-lens", "16,32", "--heads", "2", "--head-dim", "8",
               "--rep-ms", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("provider"))
    assert "GFLOP/s" in header and "TFLOP/s" not in header and "peak GiB" not in header
    data = json.loads((tmp_path / "bench.json").read_text())
    rates = [float(line.split()[3]) for line in out.splitlines()
             if line.split() and line.split()[0] in ("ttt_flash", "math", "sdpa")]
    assert len(rates) == 6 and all(r > 0 for r in rates)  # printed with enough digits to be non-zero
    assert plot_panels(data) == ["time"]  # no empty memory panel on the CPU
    # a CUDA result (peak memory, TFLOP/s-scale rates) keeps both
    cuda_rows = [{"provider": "ttt_flash", "N": 4096, "ms": 1.0, "tflops": 120.0, "peak_gib": 0.5,
                  "ratio_sdpa_flash": 3.0, "ratio_sdpa_cudnn": 3.5}]
    cuda = {**data, "rows": cuda_rows}
    assert plot_panels(cuda) == ["time", "memory"] and flop_unit(cuda_rows) == ("TFLOP/s", 1.0)
    table = format_table(cuda)
    assert "TFLOP/s" in table and "peak GiB" in table and "/cudnn" in table and "120.0" in table


def test_graph_chain_table_shows_both_backward_placements():
    from ttt_flash.bench.graph import format_table as graph_table

    row = dict(part="chain", batch=1, n=1024, causal=True, kernel_ms=0.2, graph_ms=0.21, graph_equal=True,
               eager_ms=0.7, host_ms=0.65, sdpa_flash_ms=0.15, eager_over_sdpa=4.5, graph_over_kernel=1.05,
               eager_threads_ms=1.2, host_threads_ms=1.1, sdpa_flash_threads_ms=0.31, eager_over_sdpa_threads=3.9,
               rounds=5)
    header, line = graph_table({"rows": [row]}).splitlines()
    assert "autograd threads" in header
    assert line.startswith("B1 N1024 causal") and "4.50" in line
    assert line.split("|")[1].split() == ["1.20", "1.10", "0.31", "3.90"]
