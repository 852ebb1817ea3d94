"""Checks of what the command line prints."""


def one_sentence(capsys, *needles):
    """The captured stderr is one line, no traceback, holding every one of ``needles``; returns
    it."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
