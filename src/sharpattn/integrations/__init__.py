"""The optional integrations' implementations, each imported only when asked for.

``sharpattn.hf`` (the ``hf`` extra: transformers) is the public name of [`hf`][sharpattn.integrations.hf]: import it as
``import sharpattn.hf``. ``pretrained`` loads the packaged models (the ``pretrained`` extra).
"""
