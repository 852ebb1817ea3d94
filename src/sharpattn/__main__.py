"""The ``sharpattn`` command's entry point (also ``python -m sharpattn``).

It checks that the ``cli`` extra is installed before it imports the command (click, rich), so a
library-only install gets one sentence and exit code 2 instead of a traceback. Without the extra,
``sharpattn``, ``sharpattn --help`` and ``sharpattn info`` still work: the first two list the
commands (``COMMANDS``, held equal to the real ones by a test) and say how to get them.
"""

from __future__ import annotations

import sys

from .extras import install, missing

#: The command's subcommands and their one-line help, for ``--help`` without the cli extra
#: (tests/api/test_lean_install.py holds them equal to ``sharpattn.cli``'s).
COMMANDS = {
    "corollary-b1": "Corollary B.1 on a trained max-retrieval run.",
    "demo": "Softmax vs adaptive temperature as n grows (Lemma 2.1).",
    "diagnose": "Dispersion, sinks and heads of a Hugging Face model.",
    "dispersion": "The winner's weight vs n for every normalizer.",
    "fit-temperature": "Refit adaptive temperature on a max-retrieval run.",
    "info": "Which code paths run on this machine, and the native build cache.",
    "leaderboard": "Every attention method ranked on sequence tasks.",
    "list": "The registry of attention normalizers as a table.",
    "llm": "Max of n and perplexity on a pretrained LLM.",
    "reproduce": "Reproduce a paper's experiment (resumable).",
}


def lean_help(absent: list[str]) -> str:
    """``sharpattn --help`` where the cli extra is missing: the commands, and the install line."""
    width = max(map(len, COMMANDS))
    lines = [
        "Usage: sharpattn [OPTIONS] COMMAND [ARGS]...",
        "",
        "  sharpattn: sharp attention at any input size.",
        "",
        "Commands:",
        *(f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()),
        "",
        f"Every command but `info` needs the cli extra ({', '.join(absent)} missing):",
        f"  {install('cli')}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    absent = missing("cli")
    if absent:
        if not args or args[0] in ("-h", "--help"):
            print(lean_help(absent))
            return 0
        if args == ["info"]:
            from .attention.dispatch.machine import info_text

            print(info_text())
            return 0
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
