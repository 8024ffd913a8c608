"""The ``ttt-flash`` command line."""

import shutil
import subprocess
import sys

import pytest

import ttt_flash
from ttt_flash.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ttt-flash {ttt_flash.__version__}"


def test_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: ttt-flash" in out and "check" in out


def test_unknown_command_fails():
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2


def test_check_passes_and_prints_table(capsys):
    assert main(["check", "--seq-len", "19", "--head-dim", "8", "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert "q_bar" in out and out.strip().endswith("OK")


def test_console_script_is_installed():
    exe = shutil.which("ttt-flash")
    assert exe is not None, "pip install -e . should install the ttt-flash console script"
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"ttt-flash {ttt_flash.__version__}"
    r = subprocess.run([sys.executable, "-m", "ttt_flash.cli", "--help"], capture_output=True, text=True, check=True)
    assert "check" in r.stdout
