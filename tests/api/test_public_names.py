"""What the packages export: public names only; internals stay importable by their module path."""

import importlib

import pytest

PACKAGES = [
    "sharpattn",
    "sharpattn.normalizers",
    "sharpattn.attention",
    "sharpattn.diagnostics",
    "sharpattn.models",
    "sharpattn.tasks",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_holds_public_names_from_public_modules(name):
    """Every name in ``__all__`` exists, is public, and (functions, classes) is defined in a
    public module: nothing of a private module such as ``normalizers._contract`` is exported."""
    package = importlib.import_module(name)
    private = []
    for export in package.__all__:
        obj = getattr(package, export)  # AttributeError: listed but missing
        module = getattr(obj, "__module__", None) if callable(obj) else None
        if export.startswith("_") and export != "__version__":
            private.append(export)
        elif module is not None and any(p.startswith("_") for p in module.split(".")):
            private.append(f"{export} (from {module})")
    assert not private, f"{name}.__all__ exports " + ", ".join(private)


def test_contract_building_blocks_are_imported_from_their_module():
    import sharpattn.normalizers as nz
    from sharpattn.normalizers._contract import finish, masked_softmax, prepare

    assert {"prepare", "masked_softmax", "finish"}.isdisjoint(nz.__all__)
    assert callable(prepare) and callable(masked_softmax) and callable(finish)


def test_the_hooks_length_term_is_public():
    """``log_n``, the log n a family's hooks use (``bias - log_n(n)``), is public in the module
    where hooks are written, and defined there: the guide's plug-in example imports it."""
    from sharpattn.normalizers import _contract, families
    from sharpattn.normalizers.families import log_n

    assert "log_n" in families.__all__
    assert log_n.__module__ == "sharpattn.normalizers.families"
    assert not hasattr(_contract, "log_n")
