"""The ``petfunc`` command: ``python -m petfunc`` and the console entry point."""

import importlib.metadata

import pytest

from petfunc.cli import main


def test_python_dash_m(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "petfunc", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--restart" in out.stdout


def test_entry_point_declared():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("petfunc") == "petfunc.cli:main"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


def test_parser_has_the_three_commands_and_points_to_the_options_reference(capsys):
    from petfunc.cli.commands import COMMANDS, parser

    assert sorted(COMMANDS) == ["eval", "export", "train"]
    args = parser().parse_args(["train", "options.yaml", "--epochs", "3", "--threads", "2"])
    assert (args.command, args.options, args.epochs, args.threads) == ("train", "options.yaml", 3, 2)
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--help"])
    assert "docs/options.md" in capsys.readouterr().out
