"""The library's layers import in one direction, and only torch, numpy and entmax (the
integrations also their extras' modules), checked on the source: every import statement, also
the ones inside functions that run only on some paths. The reproductions (experiments/, cli*.py)
use only the library's public API; the experiment kit (lab/) is used by them and never uses
them."""

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
    "integrations": {"normalizers", "attention", "diagnostics", "models", "hf", "extras"},
    "hf": {"integrations"},
    "__init__": {"normalizers", "attention", "hf"},
}
THIRD_PARTY = {"torch", "numpy", "entmax"}
INTEGRATIONS_MAY = set(EXTRAS["hf"]) | set(EXTRAS["pretrained"])
#: the optional kernel package of the attention layer (the CUDA tier), imported only where its
#: extra is installed (``attention.devices.triton_kernels``, once ``devices.backend`` chose it),
#: and the modules it may import
OPTIONAL_KERNELS = {"triton": set(EXTRAS["gpu"])}


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
        elif top in OPTIONAL_KERNELS.get(path.parent.name, ()) and layer == "attention":
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


# --- the kernel library's tiers: no import circle, no private name of another module ----------

#: the attention layer's tiers (its packages) and the tiers each may import; the modules at the
#: top of the layer (attend, the modules, masking, statistics, the backend choice) are "base"
TIERS = {
    "base": {"base", "reference", "cpu", "triton", "dispatch"},
    "reference": {"base", "reference"},
    "triton": {"base", "triton"},
    "cpu": {"base", "reference", "cpu"},
    "dispatch": {"base", "reference", "cpu", "dispatch"},
}
#: the layers whose modules must form no import circle (every import statement counts, also
#: one inside a function: a circle made late still ties the modules together)
ACYCLIC = ("attention", "normalizers")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(sources: dict[Path, str]) -> dict[str, set[str]]:
    """module -> the library modules it imports (``from . import a`` imports module ``a``)."""
    modules = {_module(p) for p in sources}
    graph = {}
    for path, source in sources.items():
        deps = set()
        for _, module in _imports(path, source):
            deps.add(module)
        for node in ast.walk(ast.parse(source)):  # from X import name: X.name where a module
            if isinstance(node, ast.ImportFrom):
                here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module) if p)
                deps.update(f"{module}.{a.name}" for a in node.names)
        graph[_module(path)] = {d for d in deps if d in modules and d != _module(path)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import each other round a circle (Tarjan's components)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_kernel_library_has_no_import_circle():
    sources = {p: p.read_text() for p in LIBRARY if _layer(p) in ACYCLIC}
    assert not _circles(_graph(sources))


def test_the_circle_check_sees_a_circle_made_inside_a_function():
    """The circle the kernels once had: the backend choice importing the Triton kernels late,
    which imported the tiles, which imported the backend choice."""
    sources = {p: p.read_text() for p in LIBRARY if _layer(p) in ACYCLIC}
    triton = PACKAGE / "attention" / "triton" / "template.py"
    sources[triton] += "\n\ndef _late():\n    from ..cpu import tiled\n"
    assert any("sharpattn.attention.devices" in c for c in _circles(_graph(sources)))


def _tier(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["sharpattn", "attention"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in TIERS else "base"


@pytest.mark.parametrize(
    "path",
    [p for p in LIBRARY if _layer(p) == "attention"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_each_attention_tier_imports_only_the_tiers_below_it(path):
    tier = _tier(_module(path))
    wrong = [
        f"line {line}: {module}"
        for line, module in _imports(path, path.read_text())
        if _tier(module) is not None and _tier(module) not in TIERS[tier]
    ]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({tier}) imports " + "; ".join(wrong)


def _private_names(path: Path, source: str) -> list[str]:
    """Underscore names ``source`` imports from another module of the library (a private
    module such as ``_contract`` is its package's own business, not checked here)."""
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or "sharpattn" in (node.module or "")):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            wrong += [
                f"line {node.lineno}: {a.name}"
                for a in node.names
                if _private(a.name) and _module_file(f"{module}.{a.name}") is None
            ]
    return wrong


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_modules_private_names(path):
    wrong = _private_names(path, path.read_text())
    assert not wrong, f"{path.relative_to(PACKAGE)} imports private names: " + "; ".join(wrong)


def test_the_private_name_check_sees_a_sibling_private_import():
    path = PACKAGE / "attention" / "cpu" / "tiled.py"
    planted = path.read_text() + "\n\nfrom .fused import _entropy_pass\n"
    assert _private_names(path, planted) == [f"line {planted.count(chr(10)) - 0}: _entropy_pass"]


# --- the reproductions are a client of the library's public API ---------------------------------

#: the reproductions, their kit and the CLI: everything else of the package is the library
REPRODUCTIONS = sorted(
    [
        *(PACKAGE / "experiments").rglob("*.py"),
        *(PACKAGE / "lab").rglob("*.py"),
        *PACKAGE.glob("cli*.py"),
        PACKAGE / "__main__.py",
    ]
)


NAMEDTUPLE = {"_asdict", "_fields", "_field_defaults", "_make", "_replace"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _of_library(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "sharpattn" and not (
        len(parts) > 1
        and (parts[1] in ("experiments", "lab") or parts[1].startswith(("cli", "__main__")))
    )


def _private_uses(path: Path, source: str) -> list[str]:
    """What ``source`` (the file ``path``) takes from the library that is not its public API: an
    underscore name imported from a library module, a private library module (``_contract``),
    or an underscore attribute of a variable (``nz._get``, ``model._qkv``): of anything but
    ``self``/``cls`` and what the file imports from outside the package (``os._exit``), whose
    internals are not the library's; namedtuples' ``_replace``-style methods are public."""
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    tree = ast.parse(source, str(path))
    wrong, foreign = [], {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _of_library(alias.name):
                    foreign.add(alias.asname or alias.name.partition(".")[0])
                elif any(map(_private, alias.name.split("."))):
                    wrong.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module.partition(".")[0] != "sharpattn":
                    foreign.add(alias.asname or alias.name)
                elif any(map(_private, full.split("."))):  # the library's, or another experiment's
                    wrong.append(f"line {node.lineno}: {full}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr not in NAMEDTUPLE
            and isinstance(node.value, ast.Name)
            and node.value.id not in foreign
        ):
            wrong.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return wrong


def _planted(*lines: str) -> tuple[Path, str]:
    """A reproduction's path and its source with ``lines`` appended (a check's test input)."""
    path = PACKAGE / "experiments" / "clrs.py"
    return path, path.read_text() + "\n\n" + "\n".join(lines) + "\n"


def test_the_public_api_check_sees_private_names_modules_and_attributes():
    """An underscore name from a library module, a private library module and an underscore
    attribute of a library module or model are caught, and so is another experiment's underscore
    name (``from .backcopy import _label``); the standard library's are not."""
    wrong = _private_uses(
        *_planted(
            "def _late(m, row):",
            "    import os",
            "    from ..models.set_attention import _helper",
            "    from ..normalizers._contract import prepare",
            "    import sharpattn.normalizers._contract",
            "    from .backcopy import _label",
            "    return nz._registry, os._exit, m._qkv, row._replace, self._x",
        )
    )
    assert [w.partition(": ")[2] for w in wrong] == [
        "sharpattn.models.set_attention._helper",
        "sharpattn.normalizers._contract.prepare",
        "import sharpattn.normalizers._contract",
        "sharpattn.experiments.backcopy._label",
        "nz._registry",
        "m._qkv",
    ]


#: public module names that are another module's object (``sys.modules`` swaps them)
MODULE_ALIASES = {"sharpattn.hf": "sharpattn.integrations.hf"}


def _module_file(module: str) -> Path | None:
    """The source file of the package's module ``module`` ("sharpattn.models.transformer")."""
    module = MODULE_ALIASES.get(module, module)
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _declared_all(module: str) -> set[str]:
    """The names of ``module``'s ``__all__`` (a literal list or tuple), read from its source."""
    path = _module_file(module)
    for node in ast.parse(path.read_text()).body if path else ():
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def _unexported_uses(path: Path, source: str) -> list[str]:
    """Library names ``source`` (the file ``path``) uses that the module it takes them from does
    not list in its ``__all__``: ``from sharpattn.m import name`` and ``alias.name`` of an
    imported library module (submodules and dunders are not names of the API)."""
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    tree = ast.parse(source, str(path))
    wrong, modules = [], {}

    def check(line: int, module: str, name: str) -> None:
        full = f"{module}.{name}"
        if _module_file(full) is not None:  # a module
            return
        if name.startswith("__") or name in _declared_all(module):
            return
        wrong.append(f"line {line}: {full}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _of_library(alias.name):
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if not _of_library(full):
                    continue
                if _module_file(full) is not None:
                    modules[alias.asname or alias.name] = full
                else:
                    check(node.lineno, module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                check(node.lineno, modules[node.value.id], node.attr)
    return wrong


@pytest.mark.parametrize("path", REPRODUCTIONS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_reproductions_use_only_the_public_api(path):
    """No private name of the library or of another experiment, and only names an ``__all__``
    exports."""
    source = path.read_text()
    for what, wrong in (
        ("the library's internals", _private_uses(path, source)),
        ("names no __all__ exports", _unexported_uses(path, source)),
    ):
        assert not wrong, f"{path.relative_to(PACKAGE)} uses {what}: " + "; ".join(wrong)


def test_the_export_check_sees_names_missing_from_all():
    wrong = _unexported_uses(
        *_planted(
            "def _late():",
            "    from ..models.transformer import not_exported",
            "    from ..models import transformer",
            "    from .. import normalizers as nz2",
            "    return transformer.also_not, nz2.softmax, nz2.no_such_name, nz2.__name__",
        )
    )
    assert [w.partition(": ")[2] for w in wrong] == [
        "sharpattn.models.transformer.not_exported",
        "sharpattn.models.transformer.also_not",
        "sharpattn.normalizers.no_such_name",
    ]


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "lab").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_the_experiment_kit_never_imports_the_reproductions_or_the_cli(path):
    wrong = [
        f"line {line}: {module}"
        for line, module in _imports(path, path.read_text())
        if module.startswith(("sharpattn.experiments", "sharpattn.cli", "sharpattn.__main__"))
    ]
    assert not wrong, f"{path.relative_to(PACKAGE)} imports " + "; ".join(wrong)
