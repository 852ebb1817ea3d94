"""``sharpattn.hf``, the Hugging Face integration (``hf`` extra): the public name of the module
implemented in [`sharpattn.integrations.hf`][sharpattn.integrations.hf], one module object under both names."""

import sys

from .integrations import hf as _hf

sys.modules[__name__] = _hf
