"""Regenerate the normalizer section of docs/normalizers.md and docs/dispersion.png.

    .venv/bin/python docs/update_normalizers.py            # table + plot (runs `sharpattn dispersion`)
    .venv/bin/python docs/update_normalizers.py --table    # table only

The table comes from the registry (`sharpattn list --markdown`);
tests/experiments/test_dispersion.py fails when the page's copy is stale.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from sharpattn import normalizers as nz

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- normalizers:start -->", "<!-- normalizers:end -->"

SECTION = """{start}
Every method is a pure function `fn(scores, mask=None, **params) -> weights` behind one contract
(masked entries exactly 0, empty rows all zeros, NaN/+inf at allowed positions raise; see the
[API guide](guide.md#the-normalizer-contract)), usable as `attend(q, k, v, method=name, ...)` and
`MultiheadAttention(d, heads, method=name)`, where the learnable parameters become per-head
`nn.Parameter`s. "n" is the number of allowed keys of a row (with a causal mask: the position + 1).
The table is generated from the registry by `sharpattn list --markdown`
(`python docs/update_normalizers.py` rewrites this page's section and its figure).

{table}

### Which normalizers disperse

`sharpattn dispersion` (also part of `sharpattn demo`): logits uniform in [−1, 1], one winner at
1 + margin, n = 16 … 65,536; per method the winner's weight, the largest weight, the entropy and
the total mass, a table and this plot. Softmax's winner weight falls as 1/n (Lemma 2.1 of
Veličković et al.), and so does every method that keeps an exp or a 1/n without a length-dependent
sharpening (sink, sigmoid with its −log n bias, ReLU/n, signed, softpick; the cubic kernel more
slowly). ssmax and log-n-scaled softmax keep the winner, as do the sparse maps (top-k, hardmax,
sparsemax, entmax, asentmax) once the margin exceeds their threshold. Llama 4's temperature and
Qwen's log-n scaling are softmax up to their lengths (8192 and 2048 keys by default) and disperse
more slowly beyond (their β grows with log n, while the 1/n it must offset grows faster). Stick-breaking
prefers the nearest keys, so a winner far from the query gets almost nothing.

![winner weight vs n, one curve per normalizer](dispersion.png)
{end}"""


def section() -> str:
    return SECTION.format(start=START, end=END, table=nz.markdown_table())


def main(argv: list[str]) -> None:
    page = ROOT / "docs" / "normalizers.md"
    text = page.read_text()
    if START in text and END in text:
        text = re.sub(
            re.escape(START) + ".*?" + re.escape(END), lambda _: section(), text, flags=re.S
        )
    else:
        text = text.rstrip("\n") + "\n\n" + section() + "\n"
    page.write_text(text)
    if "--table" not in argv:
        from sharpattn.experiments import dispersion

        with tempfile.TemporaryDirectory() as tmp:
            run_dir, _ = dispersion.run(Path(tmp) / "dispersion")
            (ROOT / "docs").mkdir(exist_ok=True)
            shutil.copyfile(run_dir / "winner_weight.png", ROOT / "docs" / "dispersion.png")


if __name__ == "__main__":
    main(sys.argv[1:])
