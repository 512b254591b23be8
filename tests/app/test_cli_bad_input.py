"""A bad choice or an unknown flag on the command line is one line, exit code 2,
nothing written: like every other bad input, not argparse's whole usage block
(which ``shardwise train --model huge`` printed, 17 lines). The line names what is
accepted: an invalid choice lists the choices, an unknown flag points at ``--help``.

Every subcommand's parser is ``common.OneLineParser``; these run ``main`` in this
process (the parsing happens before any torch work), and one runs the console
command itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import one_line, shardwise


def _bad(argv: list[str], cwd: Path, capsys, monkeypatch) -> str:
    """``shardwise ARGV`` in this process from ``cwd``: exit code 2, one line on stderr,
    nothing on stdout, no file made under ``cwd``; the line."""
    from shardwise_app.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_RUN_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(cwd)
    (cwd / "run").mkdir()  # an existing run folder: the commands that read one get it
    before = sorted(cwd.rglob("*"))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "", out
    assert sorted(cwd.rglob("*")) == before  # nothing written
    line = one_line(err)
    assert line.startswith(f"shardwise {argv[0]}: error: "), line
    return line


# (argv, what the line must say). Sample and export have no flag with choices: their
# bad value is one of another type, which argparse's same error path reports.
BAD_CHOICES = [
    (
        ["train", "--model", "huge"],
        "argument --model: invalid choice: 'huge' (choose from 'tiny', 'small', 'base', "
        "'medium', 'large')",
    ),
    (
        ["train", "--mixed-precision", "fp9"],
        "argument --mixed-precision: invalid choice: 'fp9' (choose from 'none', 'bf16')",
    ),
    (
        ["plan", "--hardware", "tpu"],
        "argument --hardware: invalid choice: 'tpu' (choose from 'h100', 'h200', 'b200', 'cpu')",
    ),
    (
        ["bench", "--device", "tpu"],
        "argument --device: invalid choice: 'tpu' (choose from 'cuda', 'cpu')",
    ),
    (["sample", "--ckpt", "run", "--tokens", "many"], "argument --tokens: invalid int value"),
    (["export", "--ckpt", "run", "--out", "x", "--nproc", "two"], "argument --nproc: invalid int"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, says", BAD_CHOICES, ids=[" ".join(a) for a, _ in BAD_CHOICES])
def test_a_bad_choice_is_one_line(argv, says, tmp_path, capsys, monkeypatch) -> None:
    line = _bad(argv, tmp_path, capsys, monkeypatch)
    assert says in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--modle", "tiny"],
        ["sample", "--ckpt", "run", "--temprature", "0.5"],
        ["export", "--ckpt", "run", "--out", "x", "--adaptor-only"],
        ["plan", "--wolrd-size", "8"],
        ["bench", "--stesp", "3"],
        ["calibrate", "--outt", "rates.json"],
    ],
    ids=lambda a: " ".join(a),
)
def test_an_unknown_flag_is_one_line_naming_it(argv, tmp_path, capsys, monkeypatch) -> None:
    line = _bad(argv, tmp_path, capsys, monkeypatch)
    unknown = next(a for a in argv if a.startswith("--") and a not in _known(argv[0]))
    assert f"unrecognized arguments: {unknown}" in line, line
    assert f"'shardwise {argv[0]} --help' lists the flags" in line, line


def _known(command: str) -> set[str]:
    """The flags ``command``'s parser accepts, read from the parser itself."""
    import importlib

    from shardwise_app.cli.main import COMMANDS

    module = importlib.import_module(COMMANDS[command][0])
    build = getattr(module, "build_parser", None) or module.parser
    return {s for a in build()._actions for s in a.option_strings}


@pytest.mark.timeout(120)
def test_the_console_command_prints_one_line(tmp_path: Path) -> None:
    """The issue's own example, as a person types it: 17 lines of usage before."""
    out = shardwise("train", "--model", "huge", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    line = one_line(out.stderr)
    assert line.startswith("shardwise train: error: argument --model: invalid choice: 'huge'")
    assert list(tmp_path.iterdir()) == []
