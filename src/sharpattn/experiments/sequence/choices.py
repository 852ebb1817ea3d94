"""The sweep's methods: what a leaderboard or CLRS row trains and evaluates (`Method`), the
registry's trainable normalizers and module options, and the position schemes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...normalizers import available, plugin

#: the position schemes of a sweep's decoder (`TransformerConfig.positions` without a learned
#: table, which could not run beyond its length): RoPE, NoPE, ALiBi on every head, and NAPE
#: (ALiBi on half of the heads, NoPE on the others)
POSITIONS = ("rotary", "none", "alibi", "nape")

#: seeds of the data streams (runner.generator(seed, purpose, ...)): initial weights, training
#: batches, test sequences and the check sequences of ``converge`` (`check_sequences`)
STREAM_INIT, STREAM_DATA, STREAM_TEST, STREAM_CHECK = 1, 2, 3, 4


@dataclass(frozen=True)
class Method:
    """A row of the leaderboard: how its decoder is trained and how it is evaluated.

    ``train``: the registry normalizer in every attention layer during training; ``evaluate``:
    the normalizer at evaluation (None: the same); ``params``: fixed normalizer parameters;
    ``length_params``: parameters set to the longest training sequence (methods whose formula
    names the training length); ``selective`` / ``gate``: module options
    (`TransformerConfig`)."""

    name: str
    train: str
    evaluate: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    length_params: tuple[str, ...] = ()
    selective: str | None = None
    gate: str | None = None

    @property
    def recipe(self) -> str:
        """The training recipe: methods with the same recipe share one trained model."""
        parts = [self.train, *(f"{k}={v}" for k, v in self.params)]
        parts += [f"selective={self.selective}"] if self.selective else []
        parts += [f"gate={self.gate}"] if self.gate else []
        return ",".join(parts)


#: registry methods that cannot be trained by gradient descent, and why
UNTRAINABLE = {"hardmax": "argmax has zero gradient almost everywhere"}
#: training time relative to softmax where it is much longer (leaderboard --quick, measured:
#: entmax's bisection 6x, the other sorting-based normalizers 1.4-2.2x); orders the jobs
SLOW = {
    "entmax": 6.0,
    "entmax15": 2.2,
    "sparsemax": 1.8,
    "asentmax": 1.4,
    "topk": 1.4,
    "stick_breaking": 1.2,
    "stick_breaking_shifted": 1.2,
}
#: fixed parameters whose value is the longest training sequence (see `Method`)
LENGTH_PARAMS = {"logn": ("train_length",), "llama4_temperature": ("floor_scale",)}


def methods() -> dict[str, Method]:
    """Every method of the leaderboard: each trainable registry normalizer, stick-breaking with
    its scores shifted by −log i (query i's 1-based position), adaptive temperature and log-n
    scaling at inference only (on the softmax model: log-n is 1 up to the training length, so
    trained it is softmax), selective temperatures and gated attention."""
    out: dict[str, Method] = {}
    for name in available():
        if name in UNTRAINABLE or plugin.is_spec(name):  # a plug-in runs where it is named
            continue
        out[name] = Method(name, name, length_params=LENGTH_PARAMS.get(name, ()))
    if "stick_breaking" in out:  # scores shifted by −log i: the stick starts spread over keys
        out["stick_breaking_shifted"] = Method(
            "stick_breaking_shifted", "stick_breaking", params=(("shift_log_position", -1.0),)
        )
    out["adaptive (inference)"] = Method("adaptive (inference)", "softmax", evaluate="adaptive")
    if "logn" in out:  # 1 up to the training length: trained, it is softmax
        out["logn (inference)"] = Method("logn (inference)", "softmax", evaluate="logn")
    for which in ("q", "v", "qv"):
        out[f"selective_{which}"] = Method(f"selective_{which}", "softmax", selective=which)
    if _has_gate():
        out["gated"] = Method("gated", "softmax", gate="headwise")
    return out


def _has_gate() -> bool:
    from ...models.transformer import TransformerConfig

    return "gate" in TransformerConfig.__dataclass_fields__


def resolve(names: list[str] | tuple[str, ...] | None) -> list[Method]:
    """The methods called ``names`` (None: every one); unknown names: one sentence."""
    known = methods()
    if names is None:
        return list(known.values())
    for n in names:
        if plugin.is_spec(n) and n not in known:  # imported and probed where not yet loaded
            plugin.ensure(n)
            known[n] = Method(n, n)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(
            f"unknown leaderboard method(s) {', '.join(map(repr, bad))}; known: {', '.join(known)}."
        )
    return [known[n] for n in names]
