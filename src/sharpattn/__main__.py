"""The ``sharpattn`` command's entry point (also ``python -m sharpattn``).

It checks that the ``cli`` extra is installed before it imports the command (click, rich), so a
library-only install gets one sentence and exit code 2 instead of a traceback.
"""

from __future__ import annotations

import sys

from .extras import install, missing


def main(argv=None) -> int:
    absent = missing("cli")
    if absent:
        print(
            f"sharpattn: error: the sharpattn command needs the cli extra "
            f"({', '.join(absent)} missing): {install('cli')}.",
            file=sys.stderr,
        )
        return 2
    from .cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
