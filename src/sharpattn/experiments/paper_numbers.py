"""The papers' numbers that the reproductions' verdicts are judged against, each with its paper,
table (or figure) and row, as printed there.

* `PaperChange` — a change a paper reports, ``before`` → ``after`` (its direction is the claim).
* `PaperClaim` — a direction a paper claims without a number to compare with.

A page takes its reference from here, never from a number of its own; `selective_fine_tune` picks
the row of the Selective Attention paper that matches the arm a run trains.
"""

from __future__ import annotations

from dataclasses import dataclass

SOFTMAX_NOT_ENOUGH = "Veličković et al., Softmax is not Enough (ICML)"
SELECTIVE_ATTENTION = "Zhang et al., Selective Attention (NeurIPS 2024)"


@dataclass(frozen=True)
class PaperChange:
    """A change a paper reports: ``measure`` goes from ``before`` to ``after`` (both as printed)
    in ``where`` (a table or figure of ``paper``), row ``row``."""

    paper: str
    where: str
    row: str
    measure: str
    before: str
    after: str

    @property
    def sign(self) -> int:
        """The claimed direction: +1 where ``after`` is larger, −1 where smaller."""
        return 1 if float(self.after) > float(self.before) else -1

    @property
    def words(self) -> str:
        return f"{self.before} → {self.after}"

    @property
    def source(self) -> str:
        """Where the numbers are printed, for a page: "Table 3, Pythia-160m +SSA base"."""
        return f"{self.where}, {self.row}"


@dataclass(frozen=True)
class PaperClaim:
    """A direction a paper claims (``sign``: +1 up, −1 down) in words, with no number a run can
    be compared with: ``words`` as the page shows them, from ``where`` of ``paper``, ``row``."""

    paper: str
    where: str
    row: str
    words: str
    sign: int

    @property
    def source(self) -> str:
        return f"{self.where}, {self.row}"


# --- Softmax is not Enough ------------------------------------------------------------------

#: Table 1's sizes: in distribution 16, then out of distribution to 16,384
MAX_RETRIEVAL_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Table 1 (max retrieval, accuracy %, averaged over ten seeds): the baseline's row, adaptive
#: θ's and the paired t-test's p-value, per size
MAX_RETRIEVAL_TABLE1 = {
    "baseline": dict(
        zip(
            MAX_RETRIEVAL_SIZES,
            (98.6, 97.1, 94.3, 89.7, 81.3, 70.1, 53.8, 35.7, 22.6, 15.7, 12.4),
            strict=True,
        )
    ),
    "adaptive": dict(
        zip(
            MAX_RETRIEVAL_SIZES,
            (98.6, 97.1, 94.5, 89.9, 82.1, 72.5, 57.7, 39.4, 24.9, 17.5, 14.0),
            strict=True,
        )
    ),
    "p_value": dict(
        zip(
            MAX_RETRIEVAL_SIZES,
            (0.4, 0.4, 0.002, 2e-5, 2e-4, 3e-5, 1e-4, 6e-4, 0.02, 1e-3, 4e-3),
            strict=True,
        )
    ),
}

#: Fig. 8 (CLRS-Text, Gemma 2B fine-tuned with and without adaptive temperature): adaptive ahead
#: of the baseline beyond the training sizes on nearly all thirty algorithms
CLRS_FIG8 = PaperClaim(
    SOFTMAX_NOT_ENOUGH, "Fig. 8", "Gemma 2B, adaptive temperature", "adaptive ahead", 1
)

# --- Selective Attention --------------------------------------------------------------------

#: §4.1 and Fig. 3's caption (the 8-token graph): vanilla attention → SSA
GRAPH_CROSS_ENTROPY = PaperChange(
    SELECTIVE_ATTENTION, "Fig. 3", "vanilla → SSA", "cross-entropy", "0.0126", "0.009"
)
GRAPH_ERR_MAP = PaperChange(
    SELECTIVE_ATTENTION, "Fig. 3", "vanilla → SSA", "err_map", "0.543", "0.358"
)
#: Table 2 (denoising, MSE risk): Vanilla → Value-selective
DENOISE_MSE = PaperChange(
    SELECTIVE_ATTENTION, "Table 2", "Vanilla → Value-selective", "MSE risk", "1.390", "0.071"
)
#: Fig. 2 (Pythia pre-trained from scratch, the first 1,000 Wikitext tokens): the spikiness
#: score, vanilla → SSA (lower is spikier), and the operator norm of W, vanilla about three times
#: SSA's
SPIKINESS = PaperChange(SELECTIVE_ATTENTION, "Fig. 2", "vanilla → SSA", "spikiness", "0.39", "0.26")
QK_NORM = PaperClaim(SELECTIVE_ATTENTION, "Fig. 2", "vanilla → SSA", "≈ 3× smaller", -1)


#: Tables 5 and 6's direction (selective temperatures lower the fine-tuned perplexity), as a
#: claim on losses that cannot be compared with perplexities
TABLES_5_6_LOWER = PaperClaim(
    SELECTIVE_ATTENTION, "Tables 5-6", "Pythia / GPT2 with SSA", "lower (Tables 5-6)", -1
)


def _wikitext(where: str, row: str, before: str, after: str) -> PaperChange:
    return PaperChange(SELECTIVE_ATTENTION, where, row, "Wikitext perplexity", before, after)


#: Table 3 (fine-tune), Pythia-160m's Wikitext perplexity without SSA → with it
TABLE3_BASE = _wikitext("Table 3 (fine-tune)", "Pythia-160m +SSA base", "26.681", "26.514")
TABLE3_SHARING = _wikitext(
    "Table 3 (fine-tune)", "Pythia-160m +SSA weight sharing", "26.681", "26.780"
)
#: Tables 5 and 6 (the ablations, Pythia fine-tuned on Wikitext; their own baseline, 28.781):
#: temperatures on each of q, k, v with both terms (Table 5), and on q or v with one term
#: (Table 6)
TABLE5_BASELINE = "28.781"
ABLATIONS = {
    ("q", "both"): _wikitext("Table 5", "Pythia Q", TABLE5_BASELINE, "27.416"),
    ("k", "both"): _wikitext("Table 5", "Pythia K", TABLE5_BASELINE, "28.715"),
    ("v", "both"): _wikitext("Table 5", "Pythia V", TABLE5_BASELINE, "27.980"),
    ("kqv", "both"): _wikitext("Table 5", "Pythia K, Q, V", TABLE5_BASELINE, "26.603"),
    ("q", "position"): _wikitext("Table 6", "Pythia q, τ^pos", TABLE5_BASELINE, "27.995"),
    ("q", "token"): _wikitext("Table 6", "Pythia q, τ^tok", TABLE5_BASELINE, "27.503"),
    ("v", "position"): _wikitext("Table 6", "Pythia v, τ^pos", TABLE5_BASELINE, "28.342"),
    ("v", "token"): _wikitext("Table 6", "Pythia v, τ^tok", TABLE5_BASELINE, "27.975"),
}


def selective_fine_tune(targets: str, terms: str, sharing: bool) -> PaperChange | None:
    """The paper's fine-tuning row for selective temperatures on ``targets`` (some of q, k, v)
    with ``terms`` ("both", "token" or "position") and, for the token term, weight ``sharing``
    instead of the MLP: Table 3's base or weight-sharing row for q, v with both terms, a row of
    Tables 5-6 for the ablations it has; None where the paper has no row for that arm."""
    key = "".join(sorted(set(targets)))
    if terms != "position" and sharing:  # weight sharing is a form of the token term
        return TABLE3_SHARING if (key, terms) == ("qv", "both") else None
    if (key, terms) == ("qv", "both"):
        return TABLE3_BASE
    return ABLATIONS.get((key, terms))
