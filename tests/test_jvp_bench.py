"""ttt-flash bench --jvp on the CPU at tiny sizes: every provider and the GPT HVP run, the
correctness check passes and the JSON is written."""

import json

from ttt_flash.bench import main as bench_main
from ttt_flash.bench.jvp import default_providers


def test_bench_jvp_runs_on_cpu(tmp_path, one_thread, capsys):
    rc = bench_main(["--jvp", "--device", "cpu", "--seq-lens", "16", "--dtype", "float32", "--heads", "2",
                     "--head-dim", "8", "--rep-ms", "1", "--warmup-ms", "1", "--hvp", "--hvp-seq-len", "8",
                     "--hvp-d-model", "32", "--hvp-layers", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench_jvp.json").read_text())
    assert result["check"]["ok"]
    assert {r["provider"] for r in result["rows"]} == set(default_providers())
    assert all("ms" in r for r in result["rows"]), [r for r in result["rows"] if "ms" not in r]
    assert all("ratio_sdpa_fwd" in r for r in result["rows"] if r["provider"] in ("tangent_fwd", "jvp_bwd"))
    hvp = {r["provider"]: r for r in result["hvp"]}
    assert hvp["gpt_hvp_fwd_rev"]["rel_diff_vs_rev_rev"] < 1e-4  # float32: same product
    out = capsys.readouterr().out
    assert "tangent_fwd" in out
    header = next(line for line in out.splitlines() if line.startswith("provider"))
    assert "GFLOP/s" in header  # on the CPU: no rate column that reads 0.0
    rates = [float(line.split()[3]) for line in out.splitlines()
             if line.split() and line.split()[0] in default_providers()]
    assert rates and all(r > 0 for r in rates)


def test_bench_jvp_help_describes_every_option(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_main(["--jvp", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for opt in ("--seq-lens", "--batch", "--heads", "--head-dim", "--dtype", "--causal", "--providers",
                "--device", "--warmup-ms", "--rep-ms", "--hvp-seq-len", "--hvp-batch", "--hvp-layers",
                "--hvp-d-model", "--hvp-vocab", "--profile", "--out"):
        assert opt in text
    assert text.count("(default:") >= 16  # every option ends with its default


def test_bench_jvp_profile_on_cpu(tmp_path, one_thread, capsys):
    """--profile: time per kernel (CPU: per operator) of one jvp_bwd and one chain call."""
    rc = bench_main(["--jvp", "--device", "cpu", "--seq-lens", "16", "--dtype", "float32", "--heads", "2",
                     "--head-dim", "8", "--rep-ms", "1", "--warmup-ms", "1", "--providers", "jvp_bwd,chain",
                     "--no-check", "--profile", "--out", str(tmp_path)])
    assert rc == 0
    prof = json.loads((tmp_path / "bench_jvp.json").read_text())["profile"]["16"]
    assert set(prof) == {"jvp_bwd", "chain"}
    assert "_AttentionTangent" in prof["jvp_bwd"] and "_AttentionTangent" not in prof["chain"]
    assert all(ms > 0 for times in prof.values() for ms in times.values())
    assert "profile N=16 jvp_bwd" in capsys.readouterr().out
