"""Memory before work: every command that builds models or makes test inputs estimates its memory
from its options (`sharpattn.lab.memory`) and refuses, in one sentence with exit code 2, a run
that needs more than the machine has available, before anything is built, made or written; the
profiles fit with room to spare."""

from __future__ import annotations

import time

import pytest

from cli_checks import one_sentence
from sharpattn.cli import main
from sharpattn.lab import memory, runs

GIB = 2**30


@pytest.fixture
def free(monkeypatch):
    """``free(gib)``: the memory this machine has available, as the checks read it."""

    def set_free(gib: float) -> None:
        monkeypatch.setattr(runs, "available_memory", lambda: int(gib * GIB))

    return set_free


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["leaderboard", "--d-model", "4096", "--heads", "64", "--layers", "64"],
            ["training a decoder of 64 layers of width 4,096", "--d-model", "--layers"],
        ),
        (
            ["reproduce", "clrs", "--quick", "--eval-factor", "1024", "--d-model", "1024"],
            ["evaluating", "--eval-factor"],
        ),
        (
            ["reproduce", "clrs-llm", "--eval-sizes", "1000000000"],
            ["at sizes up to 1,000,000,000", "--eval-sizes"],
        ),
        (["reproduce", "clrs-llm", "--prompts", "1000000"], ["--prompts"]),
        (["reproduce", "selective-llm", "--context", "4096", "--lora", "1024"], ["--context"]),
        (["reproduce", "backcopy", "--paper", "--workers", "2"], ["--medium or --quick"]),
        (["reproduce", "max-retrieval", "--seeds", "10000", "--group", "10000"], ["--group"]),
    ],
)
def test_a_run_beyond_the_memory_available_is_one_sentence_before_any_work(
    argv, needles, free, capsys, monkeypatch, tmp_path
):
    free(8)
    monkeypatch.delenv("SHARPATTN_THREADS")  # refused before the line saying the threads picked
    out = tmp_path / "run"
    started = time.perf_counter()
    assert main([*argv, "--out", str(out)]) == 2
    err = one_sentence(capsys, "GiB", "more than the 8.0 GiB of memory available", *needles)
    assert err.startswith("sharpattn: error: ") and err.endswith(".")
    assert time.perf_counter() - started < 5
    assert not out.exists()


def test_a_text_file_beyond_the_memory_available_is_one_sentence(free, capsys, tmp_path):
    from sharpattn.experiments.selective_lm import load_text

    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be\n" * 1000)
    free(0.0001)
    with pytest.raises(ValueError, match=r"reading the 19,000-byte text .* --text files\.$"):
        load_text(path)


#: (command's module, profile, options) of every profile of the commands whose memory is estimated
PROFILES = [
    *(("leaderboard", p, {}) for p in ("quick", "standard", "paper")),
    *(("clrs", p, {}) for p in ("quick", "paper")),
    *(("clrs_llm", p, {}) for p in ("quick", "paper")),
    *(("selective_llm", p, {}) for p in ("quick", "paper")),
    ("selective_llm", "quick", {"lora": 8}),
    *(("backcopy", p, {}) for p in ("quick", "medium", "paper")),
    *(("max_retrieval", p, {}) for p in ("quick", "paper")),
]


@pytest.mark.parametrize("name, profile, options", PROFILES, ids=lambda v: str(v or ""))
def test_every_profile_fits_with_room_to_spare(name, profile, options, free):
    """The quick (and standard, medium) profiles fit in 4 GiB, every profile in 12 GiB: half of
    what a 24 GB machine has available."""
    import importlib

    module = importlib.import_module(f"sharpattn.experiments.{name}")
    configure = getattr(module, "configure", None) or module.make_config
    free(4 if profile != "paper" else 12)
    module.check_memory(configure(profile, **options))


def test_the_default_leaderboard_is_far_below_a_small_machine():
    from sharpattn.experiments import leaderboard
    from sharpattn.experiments import sequence as seq

    cfg = leaderboard.make_config("quick")
    job = seq.job_memory(cfg, "flip_flop")
    assert job.peak < 0.5 * GIB  # and two of them, each with its process: about 1.5 GiB


def test_the_estimate_grows_with_every_size():
    base = memory.Shape(d_model=64, heads=4, layers=2, vocab=16)

    def peak(shape=base, train=(32, 64), evaluate=(16, 1024), **options):
        return memory.estimate(shape, train=train, evaluate=evaluate, **options).peak

    wider = memory.Shape(d_model=128, heads=4, layers=2, vocab=16)
    deeper = memory.Shape(d_model=64, heads=4, layers=4, vocab=16)
    assert base.parameters < wider.parameters and base.parameters < deeper.parameters
    assert peak() < peak(wider) and peak() < peak(deeper)
    assert peak() < peak(evaluate=(16, 4096)) < peak(evaluate=(16, 16384))
    assert peak(evaluate=None) < peak(train=(64, 64), evaluate=None)
    assert peak(train=(64, 64), evaluate=None) < peak(train=(64, 256), evaluate=None)
    assert peak(evaluate=(16, 8192)) < peak(evaluate=(16, 8192), dense=True)
    assert peak() < peak(copies=2)
    assert peak(train=None, evaluate=None) == memory.FLOAT * base.parameters  # the weights alone


def test_an_estimate_is_its_largest_part_and_counts_every_job(free):
    job = memory.Estimate(model=1 * GIB, training=2 * GIB, evaluation=3 * GIB, inputs=GIB // 2)
    assert job.peak == 4.5 * GIB and job.largest == "evaluation"
    free(job.peak / GIB + 1)
    memory.check(job, 1, "one job", "sizes")
    with pytest.raises(ValueError, match=r"^two jobs needs about 10\.0 GiB, .* smaller sizes\.$"):
        memory.check(job, 2, "two jobs", "sizes")  # each with its own process


def test_the_score_bound_is_attends_own():
    """The estimate's largest score block is the one `attend` makes whole (its policy's
    ``NAIVE_MAX_ELEMENTS``), copied so that the estimate imports no torch: kept equal here."""
    from sharpattn.attention import policy

    assert memory.SCORE_ENTRIES == policy.NAIVE_MAX_ELEMENTS
