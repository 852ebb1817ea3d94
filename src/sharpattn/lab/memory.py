"""How much memory a run will need, estimated from its configuration before any model is built
or any test input generated, and refused in one sentence where it is more than this machine has
available (`runs.check_memory`).

A job holds a decoder (`Shape`: width d, MLP width m, L layers, H heads, V classes, P
parameters) and, at its peak, the larger of its two passes on T = B·n tokens (B sequences of n):

- model: 4·P bytes per copy of the weights, and 44 more per trained parameter (`TRAINED_BYTES`);
- training: 4·(L·(T·(6d + 4m) + 3·S) + 3·T·V) + 64·T bytes, S = min(B·H·n², 2²⁴) the scores
  one attention call holds (all B·H·n² for an attention that makes the whole matrix);
- evaluation: 4·(T·(4d + 3m) + 3·S + T·V) + 64·T bytes (one layer's activations at a time);
- inputs it holds throughout (test prompts made in advance).

A run of k jobs at once needs k·(peak + 512 MiB), a process's own. The constants were measured
on this package's decoder (peak resident memory of training steps with a checkpoint and of
evaluations: widths 64-1,024, 64-32,770 tokens, softmax to stick-breaking) and rounded up: on
those, an estimate is 1.2-2 times the peak measured, an upper bound rather than a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runs import check_memory

__all__ = ["Estimate", "Shape", "activation_bytes", "check", "estimate"]

#: bytes of a float32
FLOAT = 4
#: bytes per trained parameter at training's peak: the weights, their gradients and AdamW's two
#: moments (16), and a checkpoint of weights and moments serialised in memory before it is
#: written (measured 41 in all, at 100 M parameters)
TRAINED_BYTES = 48
#: floats per token and layer that training keeps for the backward pass: ``a·d_model + b·mlp``
#: (measured 15-26 ``d_model`` with an MLP of 4 ``d_model``, over normalizers from softmax to
#: stick-breaking)
TRAINING_FLOATS = (6, 4)
#: floats per token live at once in an evaluation's forward pass: ``a·d_model + b·mlp``
#: (measured 11-13 ``d_model`` with an MLP of 4 ``d_model``)
INFERENCE_FLOATS = (4, 3)
#: the most attention scores (batch × heads × rows × keys) one attention call holds: ``attend``
#: makes the whole score matrix only up to this many (its policy's ``NAIVE_MAX_ELEMENTS``), and
#: works in O(n) blocks beyond; a copy, so that the estimate imports no torch (a test keeps
#: them equal)
SCORE_ENTRIES = 2**24
#: score-sized tensors of one attention call (scores, weights and a gradient)
SCORE_COPIES = 3
#: logit-sized tensors of a training step (logits, log-softmax, their gradient); evaluation has one
LOGIT_COPIES = 3
#: bytes per token of a batch besides the model's: the int64 tokens and targets and what the
#: task makes them from
DATA_BYTES = 64
#: bytes each process running a job takes besides its job: its imports (285 MB measured) and the
#: runtime a first model and attention call add
PROCESS_BYTES = 512 << 20


@dataclass(frozen=True)
class Shape:
    """A decoder as its memory sees it: ``layers`` blocks of attention with ``heads`` heads and an
    MLP of ``mlp`` hidden units (None: 4 × ``d_model``) on a residual stream of ``d_model``,
    embeddings of ``vocab`` tokens and ``positions`` learned positions, and an output layer of
    ``n_out`` classes (None: ``vocab``), ``tied`` to the embeddings or a matrix of its own."""

    d_model: int
    heads: int
    layers: int
    vocab: int
    n_out: int | None = None
    mlp: int | None = None
    positions: int = 0
    tied: bool = False

    @property
    def hidden(self) -> int:
        """The MLP's width."""
        return self.mlp or 4 * self.d_model

    @property
    def outputs(self) -> int:
        """The output layer's classes."""
        return self.n_out or self.vocab

    @property
    def parameters(self) -> int:
        """Its parameters: q, k, v and the output projection, the MLP's two matrices and two
        LayerNorms per layer, the embeddings, the output layer and the final LayerNorm (biases
        and the normalizers' own few parameters aside)."""
        d = self.d_model
        per_layer = 4 * d * d + 2 * d * self.hidden + 4 * d
        embeddings = (self.vocab + self.positions + (0 if self.tied else self.outputs)) * d
        return embeddings + self.layers * per_layer + 2 * d


def activation_bytes(
    shape: Shape, batch: int, length: int, *, training: bool, dense: bool = False
) -> int:
    """Peak bytes of one pass of ``batch`` sequences of ``length`` tokens through ``shape``: in
    training every layer's activations kept for the backward pass, in evaluation one layer's at
    a time; the attention scores of a layer (up to `SCORE_ENTRIES` per call, or all of them where
    ``dense``: an attention that always makes the whole score matrix), the logits and the batch's
    tokens."""
    tokens = batch * length
    entries = batch * shape.heads * length * length
    if not dense:
        entries = min(entries, SCORE_ENTRIES)
    a, b = TRAINING_FLOATS if training else INFERENCE_FLOATS
    per_layer = tokens * (a * shape.d_model + b * shape.hidden) + SCORE_COPIES * entries
    floats = (shape.layers if training else 1) * per_layer
    floats += (LOGIT_COPIES if training else 1) * tokens * shape.outputs
    return FLOAT * floats + DATA_BYTES * tokens


@dataclass(frozen=True)
class Estimate:
    """One job's peak memory in bytes, in parts: ``model`` (weights, and the training state of
    the parameters it trains), ``inputs`` (what it holds throughout: test inputs made in
    advance), ``training`` and ``evaluation`` (the activations of its largest batch of each)."""

    model: int
    training: int
    evaluation: int
    inputs: int = 0

    @property
    def peak(self) -> int:
        """The job's peak: its model and inputs, and the larger of its two passes."""
        return self.model + self.inputs + max(self.training, self.evaluation)

    @property
    def largest(self) -> str:
        """The part that needs the most: "model", "inputs", "training" or "evaluation"."""
        parts = {
            "model": self.model,
            "inputs": self.inputs,
            "training": self.training,
            "evaluation": self.evaluation,
        }
        return max(parts, key=parts.__getitem__)


def estimate(
    shape: Shape,
    *,
    train: tuple[int, int] | None = None,
    evaluate: tuple[int, int] | None = None,
    trained: int | None = None,
    copies: int = 1,
    dense: bool = False,
    inputs: int = 0,
) -> Estimate:
    """The `Estimate` of a job on a decoder of ``shape``: trained on batches of ``train``
    (batch, tokens) and evaluated on batches of ``evaluate`` (None: not done). ``trained``: the
    parameters trained (None: all; fine-tuned adapters: theirs), ``copies``: copies of the
    weights held at once (a pretrained model and the copy being fine-tuned: 2), ``dense``: the
    evaluation's attention makes whole score matrices, ``inputs``: bytes held throughout."""
    if train is None:
        trained = 0
    elif trained is None:
        trained = shape.parameters
    training = evaluation = 0
    if train is not None:
        training = activation_bytes(shape, *train, training=True)
    if evaluate is not None:
        evaluation = activation_bytes(shape, *evaluate, training=False, dense=dense)
    model = copies * FLOAT * shape.parameters + (TRAINED_BYTES - FLOAT) * trained
    return Estimate(model, training, evaluation, inputs)


def check(job: Estimate, jobs: int, what: str, smaller: str) -> None:
    """Refuse, before any work, ``jobs`` jobs of ``job`` run at once (each in its own process,
    `PROCESS_BYTES` apiece) where they need more memory than is available now: one sentence,
    ``what`` needs about so much, more than is available; choose smaller ``smaller`` (the
    options that size the largest part, `Estimate.largest`)."""
    check_memory(jobs * (job.peak + PROCESS_BYTES), what, smaller)
