"""Synthetic tasks of the papers, as seeded batched generators with exact targets.

Generators import nothing above them. ``sequence`` is the common interface of the sequence tasks
(``get``, ``available``, ``SequenceTask``, ``SequenceBatch``); ``clrs_text`` and ``length_suite``
hold the CLRS-Text family and ASEntmax's synthetic suite.
"""

from . import clrs_text, length_suite, sequence
from .max_retrieval import MaxRetrievalBatch, sample_max_retrieval
from .sequence import IGNORE, SequenceBatch, SequenceTask

__all__ = [
    "IGNORE",
    "MaxRetrievalBatch",
    "SequenceBatch",
    "SequenceTask",
    "clrs_text",
    "length_suite",
    "sample_max_retrieval",
    "sequence",
]
