"""The library's layers import in one direction, and only torch, numpy and entmax (the
integrations also their extras' modules), checked on the source: every import statement, also
the ones inside functions that run only on some paths."""

import ast
import sys
from pathlib import Path

import pytest

from sharpattn.extras import EXTRAS

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "sharpattn"

#: layer -> the layers of ours it may import (DESIGN.md's order; a layer may import itself)
ALLOWED = {
    "extras": set(),
    "normalizers": set(),
    "tasks": set(),
    "attention": {"normalizers"},
    "diagnostics": {"normalizers", "attention"},
    "models": {"normalizers", "attention"},
    "integrations": {"normalizers", "attention", "diagnostics", "models", "hf"},
    "hf": {"integrations"},
    "__init__": {"normalizers", "attention", "hf"},
}
THIRD_PARTY = {"torch", "numpy", "entmax"}
INTEGRATIONS_MAY = set(EXTRAS["hf"]) | set(EXTRAS["pretrained"])


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path, source: str):
    """``(line, absolute module name)`` of every import in ``source`` (the file ``path``),
    relative ones resolved."""
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])  # its package
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1])
            if node.module:
                yield node.lineno, f"{base}.{node.module}"
            else:  # from . import a, b: each a module of ours
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"


def _violations(path: Path, source: str) -> list[str]:
    layer = _layer(path)
    wrong = []
    for line, module in _imports(path, source):
        top, _, rest = module.partition(".")
        if top == "sharpattn":
            target = rest.partition(".")[0] or "__init__"
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"line {line}: {module} (layer {target})")
        elif top in sys.stdlib_module_names or top == "__future__":
            continue
        elif top not in THIRD_PARTY and not (layer == "integrations" and top in INTEGRATIONS_MAY):
            wrong.append(f"line {line}: {module} (not a library dependency)")
    return wrong


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if _layer(p) in ALLOWED)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_layer_imports_only_what_it_may(path):
    wrong = _violations(path, path.read_text())
    assert not wrong, f"{path.relative_to(PACKAGE)} imports " + "; ".join(wrong)


def test_the_check_sees_imports_inside_functions():
    """An import inside a function, which runs only on some paths (how capture once imported
    the Hugging Face integration), is caught like one at the top."""
    path = PACKAGE / "diagnostics" / "capture.py"
    planted = path.read_text() + (
        "\n\ndef _late():\n    from ..integrations import hf\n    import scipy.stats\n"
    )
    wrong = _violations(path, planted)
    assert len(wrong) == 2, wrong
    assert "sharpattn.integrations (layer integrations)" in wrong[0]
    assert "scipy.stats (not a library dependency)" in wrong[1]
