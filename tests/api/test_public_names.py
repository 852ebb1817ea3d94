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
