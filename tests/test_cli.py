"""The ``ropestep`` console entry point registers every subcommand."""
from ropestep import cli


def test_subcommands_registered(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "validate" in out and "bench" in out and "sweep" in out
    assert cli.main(["bench", "--help"]) == 0
    assert "--max-bytes" in capsys.readouterr().out
    assert cli.main(["sweep", "--help"]) == 0  # the sweep's own arguments, from sweep.py
    assert "--kv-heads" in capsys.readouterr().out
    assert set(cli.COMMANDS) >= {"validate", "bench", "sweep"}
    assert cli.main(["frobnicate"]) == 2
