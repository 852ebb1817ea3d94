"""The character language-model part of `sharpattn reproduce selective` (tiny settings)."""

import json
from pathlib import Path

import pytest

from sharpattn.attention.selective import parameter_overhead
from sharpattn.cli import main
from sharpattn.experiments import selective_lm as exp
from sharpattn.experiments.selective import ReproduceConfig, quick_config, run

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def corpus():
    return exp.char_corpus(exp.load_text(CORPUS))


def tiny(**kw):
    base = dict(
        layers=1,
        d_model=32,
        n_heads=2,
        context=32,
        eval_contexts=(32, 64, 128),
        steps=80,
        batch=8,
        lr=3e-3,
        warmup=5,
        seeds=1,
        eval_tokens=1024,
    )
    return exp.LMConfig(**{**base, **kw})


def test_corpus_split_and_vocabulary(corpus):
    train, val, vocab = corpus
    assert len(vocab) == 65 and vocab == sorted(vocab)
    total = len(train) + len(val)
    assert len(train) == int(total * 0.9)  # a 90/10 split in whole characters
    text = CORPUS.read_text(encoding="utf-8")
    assert "".join(vocab[i] for i in val[:50].tolist()) == text[len(train) : len(train) + 50]


def test_the_default_text_ships_with_the_package():
    """The default corpus is package data (an installed package has no ../shared): the start of
    tiny Shakespeare in whole speeches, large enough for the quick profile's evaluation."""
    path = exp.default_text_path()
    assert path.is_relative_to(Path(exp.__file__).resolve().parents[1])
    text = exp.load_text()
    full = CORPUS.read_text(encoding="utf-8")
    assert 90_000 < len(text) <= 100_000 and full.startswith(text)
    assert full[len(text) - 1 : len(text) + 1] == "\n\n"  # ends where a speech ends
    quick = quick_config().lm
    _, val, _ = exp.char_corpus(text)
    assert len(val) > max(quick.eval_contexts) * (quick.eval_tokens // max(quick.eval_contexts))


def test_variants_parse():
    assert exp.lm_variant("qv:both") == exp.lm_variant("qv · both") == "qv · both"
    assert exp.lm_variant(" vanilla ") == "vanilla"
    assert exp.lm_variant("kqv:both") == "kqv · both" and exp.lm_variant("k-both") == "k · both"
    assert len(exp.LM_VARIANTS) == 12  # vanilla, q/v/qv × both/token/position, k and kqv · both
    for bad in ("k:token", "q", "qv:tok", "q:both:x", "vk:both"):
        with pytest.raises(ValueError, match="variant"):
            exp.lm_variant(bad)


def test_paired_models_start_identical_and_run_at_4x_context(corpus):
    train, _, vocab = corpus
    cfg = tiny()
    idx = train[: 4 * cfg.context].view(1, -1)  # 4x the training context
    vanilla = exp.lm_model(cfg, len(vocab), "vanilla", seed=3)(idx)
    assert vanilla.shape == (1, 4 * cfg.context, len(vocab))
    for variant in ("q · both", "v · position", "qv · token", "k · both", "kqv · both"):
        model = exp.lm_model(cfg, len(vocab), variant, seed=3)
        assert parameter_overhead(model).added > 0
        # identical weights; at init τ − 1 = c₀·log n ≈ 5.1e-6·log 128 (a model difference, not
        # rounding) moves each logit by about that relative amount: 1e-4 bounds it with room
        rel = ((model(idx) - vanilla).abs().max() / vanilla.abs().max()).item()
        assert rel < 1e-4, (variant, rel)


def test_a_tiny_training_run_learns(corpus, tmp_path):
    train, val, vocab = corpus
    out = exp.lm_train(tmp_path, tiny(), train, val, len(vocab), "qv · both", seed=0)
    assert out["first_train_loss"] > 3.8  # ≈ ln 65 = 4.17 at the start
    assert out["last_train_loss"] < out["first_train_loss"] - 0.8
    assert set(out["val_loss"]) == {"32", "64", "128"}
    assert all(2.0 < v < 3.6 for v in out["val_loss"].values())


def test_lm_only_run_writes_report_and_plot(tmp_path):
    lc = tiny(steps=3, variants=("vanilla", "v · token"), text=str(CORPUS), seeds=2)
    config = ReproduceConfig(lm=lc, tasks=("lm",))
    run_dir, result = run(tmp_path / "run", config)
    assert "graph" not in result and "denoise" not in result
    assert [r["variant"] for r in result["lm"]] == ["vanilla", "v · token"]
    assert (run_dir / "lm.png").stat().st_size > 1000
    report = (run_dir / "report.md").read_text()
    assert "ours, not the paper's" in report and "val loss @ 128" in report
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert len(metrics["lm_runs"]) == 4  # 2 variants × 2 seeds


def test_cli_missing_text_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    argv = ["reproduce", "selective", "--tasks", "lm", "--text", str(missing)]
    assert main(argv + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no text file" in err and str(missing) in err and "\n" not in err
    assert not (tmp_path / "run").exists()  # failed before creating the run folder
    assert main(["reproduce", "selective", "--tasks", "lm,x", "--out", str(tmp_path / "r")]) == 2
    assert main(["reproduce", "selective", "--lm-variants", "k:token"]) == 2
