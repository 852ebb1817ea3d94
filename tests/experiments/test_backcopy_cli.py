"""`sharpattn reproduce backcopy`: argument errors are one line on stderr and exit code 2."""

import pytest

from sharpattn.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["reproduce", "backcopy", "--threads", "0"], "--threads"),
        (["reproduce", "backcopy", "--seed", "x"], "--seed"),
        (["reproduce", "backcopy", "--bogus"], "--bogus"),
        (["reproduce", "nope"], "nope"),
    ],
)
def test_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sharpattn: error:") and needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_out_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert main(["reproduce", "backcopy", "--quick", "--out", str(f)]) == 2
    assert "file.txt" in capsys.readouterr().err


def test_a_folder_holding_another_run_is_refused(tmp_path, capsys):
    run = tmp_path / "r" / "runs" / "1L-softmax-adam"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"run": {"steps": 1}}\n')
    assert main(["reproduce", "backcopy", "--quick", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "not a backcopy-training run" in err and len(err.strip().splitlines()) == 1


def test_help_lists_the_command(capsys):
    assert main(["reproduce", "--help"]) == 0
    assert "backcopy" in capsys.readouterr().out
