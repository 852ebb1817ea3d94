"""The install without extras: the library runs on torch, numpy and entmax alone, and whatever
needs an extra says which one, in one sentence, exit code 2.

No second install: each check runs in a subprocess that makes the optional modules unimportable
(``sys.modules[name] = None``, which is what a missing package looks like to ``import``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sharpattn.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
#: every module an extra brings
OPTIONAL = sorted({name for names in EXTRAS.values() for name in names})


def _run(code: str, blocked, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which the modules ``blocked`` cannot be imported."""
    prelude = f"import sys\nfor _name in {sorted(blocked)!r}:\n    sys.modules[_name] = None\n"
    path = [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


LIBRARY = """
import pkgutil
import torch
import sharpattn
from sharpattn import diagnostics, normalizers

# every module of the library's layers imports, but the optional kernels (the gpu extra)
KERNELS = {"sharpattn.attention.triton", "sharpattn.attention.triton.stick"}
for package in ("normalizers", "attention", "diagnostics", "models", "tasks", "integrations"):
    root = __import__(f"sharpattn.{package}", fromlist=["_"])
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if info.name not in KERNELS:
            __import__(info.name)
import sharpattn.hf  # importable; its functions need transformers
from sharpattn.attention import devices

# without triton the CUDA path of sigmoid, relu and stick-breaking is the tiles'
assert devices.triton_kernels() is None
for _name in ("sigmoid", "stick_breaking"):
    _kernel = normalizers.get(_name).family.kernel
    assert devices.backend(_kernel, torch.device("cuda"), torch.float16, False) == "tiles"

torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
out, stats = sharpattn.attend(q, k, v, method="adaptive", causal=True, return_stats=True)
assert out.shape == (1, 2, 8, 4) and stats.entropy.shape == (1, 2, 8)
mha = sharpattn.MultiheadAttention(16, 2, method="adaptive", causal=True)
x = torch.randn(1, 8, 16)
with diagnostics.capture(mha) as cap:
    y = mha(x)
    y.sum().backward()
w = cap["layers.0.attn.weights"]
assert w.shape == (1, 2, 8, 8) and torch.allclose(w.sum(-1), torch.ones(1, 2, 8))
assert normalizers.sparsemax(torch.tensor([[1.0, 2.0]])).shape == (1, 2)
try:
    sharpattn.hf.apply(mha, "softmax")
except ImportError as e:
    assert "pip install -c constraints.txt -e '.[hf]'" in str(e), e
else:
    raise AssertionError("sharpattn.hf.apply ran without transformers")
"""

HF = """
import torch
import sharpattn, sharpattn.hf
from sharpattn import diagnostics
import tiny_hf

torch.manual_seed(0)
model = tiny_hf.llama().eval()
ids = torch.randint(0, 97, (1, 6))
with torch.no_grad():
    before = model(ids).logits
    sharpattn.hf.apply(model, "softmax")
    with diagnostics.capture(model) as cap:
        after = model(ids).logits
assert model.config._attn_implementation == "sharpattn:softmax"
assert torch.allclose(before, after, atol=1e-5), (before - after).abs().max()
assert cap["layers.1.attn.weights"].shape == (1, 4, 6, 6)
sharpattn.hf.apply(model, "adaptive")
with torch.no_grad():
    model(ids)
"""


def test_library_runs_without_any_extra_and_the_command_names_its_extra():
    """The library's whole public surface on torch, numpy and entmax; then the ``sharpattn``
    command (its entry point) says that it needs the cli extra."""
    code = LIBRARY + "from sharpattn.__main__ import main\nsys.exit(main(['list']))\n"
    proc = _run(code, OPTIONAL)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sharpattn: error: the sharpattn command needs the cli extra")
    assert "pip install -c constraints.txt -e '.[cli]'" in lines[0]


def test_help_without_the_cli_extra_lists_the_commands_and_the_install_line():
    """``sharpattn --help`` (and ``sharpattn`` alone) on a library-only install: the commands,
    exit 0, and the line that installs them; ``sharpattn info`` runs there too."""
    code = "from sharpattn.__main__ import main\nsys.exit(main({!r}))\n"
    for argv in (["--help"], [], ["-h"]):
        proc = _run(code.format(argv), OPTIONAL)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert out.startswith("Usage: sharpattn"), out
        for name in ("diagnose", "reproduce", "leaderboard", "info"):
            assert f"\n  {name} " in out, out
        assert out.rstrip().endswith("pip install -c constraints.txt -e '.[cli]'"), out
    proc = _run(code.format(["info"]), OPTIONAL)
    assert proc.returncode == 0, proc.stderr
    assert "C++ tile loops" in proc.stdout and "SHARPATTN_COMPILE=0" in proc.stdout


def test_the_lean_help_names_every_command():
    """__main__.COMMANDS (the help without click) is the real command's list, help for help."""
    pytest.importorskip("click")
    import click

    from sharpattn.__main__ import COMMANDS
    from sharpattn.cli import cli

    ctx = click.Context(cli)
    real = {n: cli.get_command(ctx, n).get_short_help_str(200) for n in cli.list_commands(ctx)}
    assert COMMANDS == real


def test_hf_apply_and_capture_need_transformers_only():
    """``hf.apply`` and capture of a Hugging Face model: the hf extra (transformers and its own
    safetensors) and nothing of the cli or pretrained extras."""
    allowed = set(EXTRAS["hf"])
    proc = _run(HF, [m for m in OPTIONAL if m not in allowed])
    assert proc.returncode == 0, proc.stderr


def test_command_without_its_extra_says_which_in_one_sentence(tmp_path):
    """``sharpattn diagnose`` without transformers: one sentence naming the extra, exit code 2,
    no traceback (it used to end in one)."""
    blocked = [m for m in OPTIONAL if m not in EXTRAS["cli"]]
    args = ["diagnose", "--out", str(tmp_path / "diag")]
    proc = _run(f"from sharpattn.__main__ import main\nsys.exit(main({args!r}))\n", blocked)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "sharpattn: error: this command needs transformers, from the pretrained extra: "
        "pip install -c constraints.txt -e '.[pretrained]'."
    ], proc.stderr


def _requirements(table: dict, names: list[str]) -> set[str]:
    """The import names of requirement strings, self-references (``sharpattn[hf]``) expanded."""
    out = set()
    for req in names:
        name = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()
        if name == "sharpattn":
            for extra in re.search(r"\[(.*)\]", req).group(1).split(","):
                out |= _requirements(table, table[extra.strip()])
        else:
            out.add(name.replace("-", "_"))
    return out


def test_extras_table_mirrors_pyproject():
    """``sharpattn.extras.EXTRAS`` (what the command checks and names) is pyproject's extras;
    the library needs torch, numpy and entmax only; dev holds every extra; the console script is
    the entry point that checks the cli extra before importing click."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert _requirements(extras, project["dependencies"]) == {"torch", "numpy", "entmax"}
    for extra, modules in EXTRAS.items():
        assert _requirements(extras, extras[extra]) == set(modules), extra
    assert _requirements(extras, extras["dev"]) >= set(OPTIONAL)
    assert project["scripts"] == {"sharpattn": "sharpattn.__main__:main"}
