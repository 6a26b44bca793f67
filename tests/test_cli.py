"""The ``ropestep`` console entry point registers every subcommand."""
from ropestep import cli


def test_subcommands_registered(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "validate" in out and "bench" in out
    assert cli.main(["bench", "--help"]) == 0
    assert "--max-bytes" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
