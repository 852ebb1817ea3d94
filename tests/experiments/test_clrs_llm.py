"""CLRS-Text by fine-tuning a pretrained decoder (``reproduce clrs-llm``), on the tiny random
Llama of tests/tiny_hf.py: only the adapters train, both methods start from the same adapters on
the same batches, exact match is what greedy decoding gives, resume after ``kill -9`` with the
numbers of an uninterrupted run, and one-sentence errors."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tiny_hf
from processes import killed_and_whole, same_fine_tunings
from sharpattn.cli import main
from sharpattn.experiments import adapters
from sharpattn.experiments import clrs_llm as cl
from sharpattn.integrations import pretrained
from sharpattn.lab.runner import generator


def _cfg(**kw) -> cl.Config:
    # sizes 2, 3 (trained) and 6 (2x): every prompt fits the tiny model's 64 positions
    return cl.Config(
        **{
            "tasks": ("minimum", "binary_search"),
            "train_sizes": (2, 3),
            "eval_factor": 2,
            "steps": 12,
            "batch": 4,
            "lr": 3e-2,
            "rank": 4,
            "prompts": 6,
            "eval_batch": 4,
            "checkpoint_every": 4,
            "threads": 1,
            **kw,
        }
    )


def _base_weights(net) -> dict[str, torch.Tensor]:
    """The pretrained weights (under peft's names once adapters are in: ``base_layer``)."""
    return {
        k.replace(".base_layer", ""): v.detach().clone()
        for k, v in net.state_dict().items()
        if "lora_" not in k
    }


def test_a_fine_tuning_trains_the_adapters_only_and_learns(tmp_path):
    net, tok = tiny_hf.pretrained()
    before = _base_weights(net)
    cfg = _cfg()
    ts = {name: cl.task(name, cfg) for name in cfg.tasks}
    tests = {(n, s): cl.test_prompts(t, s, cfg, tok) for n, t in ts.items() for s in cfg.sizes}
    res = cl.fine_tune(tmp_path, net, "adaptive", 0, cfg, ts, tok, tests, None)
    after = _base_weights(net)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the pretrained model frozen
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all(adapters.is_adapter(n) for n in trained)  # adaptive has no parameters
    saved = load_file(tmp_path / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # what the Trainer kept: the adapters
    assert res["training"]["method_parameters"] == 0
    # tiny_hf.llama: 2 layers of q, k, v, o (32 -> 32, 16, 16, 32: 2 key/value heads of 8); a
    # rank-r adapter of a d_in -> d_out map holds r·(d_in + d_out) parameters
    assert res["training"]["adapter_parameters"] == 2 * 4 * (64 + 48 + 48 + 64)
    assert any(
        float(p.detach().abs().sum()) > 0 for n, p in net.named_parameters() if "lora_B" in n
    )
    assert res["training"]["last_loss"] < res["training"]["first_loss"]
    assert set(res["scores"]) == set(tests)


def test_both_methods_start_from_the_same_adapters_on_the_same_batches():
    net, _ = tiny_hf.pretrained()
    arms = {m: copy.deepcopy(net) for m in cl.METHODS}
    held = {m: adapters.prepare(arm, m, {}, 4, seed=3) for m, arm in arms.items()}
    a, b = (h.state_dict() for h in held.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = adapters.prepare(copy.deepcopy(net), "softmax", {}, 4, seed=4).state_dict()
    assert not all(torch.equal(a[k], other[k]) for k in a)  # the adapters come from the seed
    assert [arm.config._attn_implementation for arm in arms.values()] == [
        "sharpattn:softmax",
        "sharpattn:adaptive",
    ]
    cfg = _cfg()
    ts = [cl.task(n, cfg) for n in cfg.tasks]
    first, second = (cl.draw(ts, cfg, generator(3, cl.STREAM_TRAIN)) for _ in range(2))
    assert [(t.name, r.tolist()) for t, r in first] == [(t.name, r.tolist()) for t, r in second]


def test_exact_match_is_what_greedy_decoding_gives():
    """An answer scores as an exact match exactly when ``generate`` (greedy, with its KV cache)
    produces it: the continuation greedy decoding gives is one, the same with one token changed
    is not."""
    net, tok = tiny_hf.pretrained()
    adapters.prepare(net, "adaptive", {}, 4, seed=0)
    with torch.no_grad():  # adapters away from zero: a model that is not the pretrained one
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    cfg = _cfg()
    t = cl.task("binary_search", cfg)
    pairs = []
    for q, _ in cl.test_prompts(t, 6, cfg, tok):
        out = net.generate(
            torch.tensor([q]), max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id
        )
        pairs.append((q, out[0, len(q) :].tolist()))
    wrong = [(q, a[:-1] + [(a[-1] + 1) % 97]) for q, a in pairs]
    assert cl.score(net, pairs, 0, 4)["exact"] == [1] * len(pairs)
    scored = cl.score(net, wrong, 0, 4)
    assert scored["exact"] == [0] * len(pairs)
    assert scored["right"] == [len(a) - 1 for _, a in wrong]


def test_the_study_writes_its_report_and_paired_tests(tmp_path):
    net, tok = tiny_hf.pretrained()
    run, m = cl.run(tmp_path / "r", _cfg(steps=4), net=net, tok=tok)
    assert len(m["rows"]) == 2 * 2 * 2 * 3  # tasks x methods x seeds x sizes
    assert {(e["task"], e["size"]) for e in m["sizes"]} == {
        (t, s) for t in ("minimum", "binary_search") for s in (2, 3, 6)
    }
    assert [e["in_training"] for e in m["sizes"][:3]] == [True, True, False]
    assert set(m["training"]) == {f"{a} seed {s}" for a in cl.METHODS for s in (0, 1)}
    for name in ("report.md", "clrs_llm.md", "clrs_llm.csv", "fig8.png", "metrics.json"):
        assert (run / name).is_file()
    report = (run / "report.md").read_text()
    assert "### n = 6 (2× the largest training size)" in report
    # beyond training, judged over seeds (the randomised unit); prompts' p-values secondary
    assert "## Verdict over seeds" in report and "p (prompts, secondary)" in report
    judged = cl.seed_verdicts(m["sizes"])
    assert [(v["task"], v["size"]) for v in judged] == [("minimum", 6), ("binary_search", 6)]
    for v in judged:
        assert v["exact"].effect.n == 2 and v["exact"].verdict in report


def test_cells_beyond_training_are_one_holm_family_per_measure():
    """Each measure's cells with a test are one family (cells equal on every seed do not
    count); the pooled comparison per algorithm is its own family over the algorithms."""
    from sharpattn.lab.stats import holm, paired_effect

    def cell(task, size, soft, adapt, tok_soft, tok_adapt, inside=False):
        return {
            "task": task,
            "size": size,
            "in_training": inside,
            "softmax_exact_seeds": soft,
            "adaptive_exact_seeds": adapt,
            "softmax_tokens_seeds": tok_soft,
            "adaptive_tokens_seeds": tok_adapt,
        }

    z = [0.0, 0.0, 0.0]
    sizes = [
        cell("a", 4, [0.9, 0.8, 0.85], [0.7, 0.8, 0.9], [0.9] * 3, [0.9] * 3, inside=True),
        cell("a", 16, [0.3, 0.2, 0.25], [0.1, 0.05, 0.12], [0.8, 0.7, 0.75], [0.6, 0.5, 0.6]),
        cell("a", 32, z, z, [0.5, 0.4, 0.45], [0.4, 0.41, 0.3]),
        cell("b", 16, [0.5, 0.4, 0.6], [0.55, 0.41, 0.62], [0.7, 0.6, 0.8], [0.7, 0.6, 0.8]),
    ]
    judged = cl.seed_verdicts(sizes)
    assert [(v["task"], v["size"]) for v in judged] == [("a", 16), ("a", 32), ("b", 16)]
    assert [v["exact"].m for v in judged] == [2, 2, 2]  # a@32 is 0 on every seed: no test
    assert [v["tokens"].m for v in judged] == [2, 2, 2]  # b@16 tokens equal: no test
    raw = [paired_effect(e["softmax_exact_seeds"], e["adaptive_exact_seeds"]).p for e in sizes[1:]]
    want = holm(raw)
    for v, w in zip(judged, want, strict=True):
        assert v["exact"].adjusted_p == pytest.approx(w, nan_ok=True)
    pooled = cl.pooled_beyond(sizes, ["a", "b"])
    assert [v["task"] for v in pooled] == ["a", "b"] and pooled[0]["verdict"].m == 2
    assert pooled[0]["softmax"] == pytest.approx(np.mean([0.3, 0.2, 0.25, 0, 0, 0]))


def test_bad_configurations_are_refused_in_one_sentence(tmp_path):
    net, tok = tiny_hf.pretrained()
    with pytest.raises(ValueError, match="beyond the model's context"):
        cl.run(tmp_path / "a", _cfg(eval_factor=8), net=net, tok=tok)
    assert not (tmp_path / "a").exists()  # refused before a folder was written
    with pytest.raises(ValueError, match="unknown algorithm 'sorting'"):
        _cfg(tasks=("sorting",))
    with pytest.raises(ValueError, match="train_sizes"):
        _cfg(train_sizes=(4, 2))
    with pytest.raises(ValueError, match="unknown profile"):
        cl.make_config("huge")


@pytest.mark.parametrize(
    "argv", [["reproduce", "clrs-llm"], ["reproduce", "selective-llm", "--lora", "4"]]
)
def test_a_missing_peft_is_named_with_its_extra(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails as when not installed
    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "sharpattn: error: this command needs peft, from the pretrained extra: "
        "pip install -c constraints.txt -e '.[pretrained]'."
    ]
    assert not (tmp_path / "run").exists()


#: the command on tests/tiny_hf.py's Llama: sizes 4 and 8 only (8 items fit its 64 positions)
CLI = [
    "reproduce",
    "clrs-llm",
    "--quick",
    "--tasks",
    "minimum,binary_search",
    "--eval-factor",
    "1",
    "--prompts",
    "4",
    "--rank",
    "4",
    "--checkpoint-every",
    "20",
    "--threads",
    "1",
]


def test_a_run_killed_with_sigkill_resumes_to_the_numbers_of_an_uninterrupted_one(
    tmp_path, monkeypatch
):
    """A real ``kill -9`` once the first fine-tuning wrote its first checkpoint, then the command
    again and an uninterrupted run (in this process, the global generator in another state): the
    same metrics, training logs and adapters."""
    args = [*CLI, "--steps", "60"]
    killed_and_whole(args, tmp_path, "seed0/softmax/checkpoint.safetensors", monkeypatch)
    trainings = [f"seed{s}/{m}" for s in (0, 1) for m in cl.METHODS]
    same_fine_tunings(tmp_path / "killed", tmp_path / "whole", trainings)


def _recording_run(monkeypatch) -> list:
    """Replace the study's ``run`` by one that records its configuration and writes a stub
    report; the list of configurations seen."""
    seen = []

    def run(out, cfg, progress):
        seen.append(cfg)
        Path(out).mkdir()
        (Path(out) / "clrs_llm.md").write_text("table")
        return Path(out), {}

    monkeypatch.setattr(cl, "run", run)
    return seen


def test_the_command_runs_its_profile_with_the_options_given(tmp_path, monkeypatch):
    seen = _recording_run(monkeypatch)
    assert main(["reproduce", "clrs-llm", "--seeds", "3", "--out", str(tmp_path / "q")]) == 0
    assert seen == [cl.make_config("quick", seeds=3, checkpoint_every=50, threads=1)]


def test_train_sizes_reach_the_configuration_and_bad_ones_are_refused(
    tmp_path, monkeypatch, capsys
):
    seen = _recording_run(monkeypatch)
    argv = ["reproduce", "clrs-llm", "--out", str(tmp_path / "q"), "--train-sizes"]
    assert main([*argv, "4,16"]) == 0
    assert seen[-1].train_sizes == (4, 16)
    for bad in ("16,4", "4", "a,b", "0,3"):
        assert main([*argv, bad]) == 2
        err = capsys.readouterr().err
        assert "--train-sizes" in err and "Traceback" not in err, err
    assert len(seen) == 1


def test_a_run_packed_without_weights_resumes_without_training(tmp_path, monkeypatch):
    """A finished run folder without its weights, checkpoints and training logs (how a record
    is packed) gives the same metrics again, loading no adapters and taking no training step;
    a new evaluation size then needs the weights, so that fine-tuning trains again."""
    import shutil

    net, tok = tiny_hf.pretrained()
    cfg = _cfg(steps=4)
    run, m = cl.run(tmp_path / "r", cfg, net=net, tok=tok)
    packed = tmp_path / "packed"
    shutil.copytree(run, packed, ignore=shutil.ignore_patterns("*.safetensors", "metrics.jsonl"))
    assert not list(packed.rglob("*.safetensors")) and list(packed.rglob("training.json"))

    def no_training(*a, **k):
        raise AssertionError("a finished fine-tuning was trained or loaded again")

    with monkeypatch.context() as mp:
        mp.setattr(cl.Trainer, "run", no_training)
        mp.setattr(cl.adapters, "prepare", no_training)
        _, again = cl.run(packed, cfg, net=net, tok=tok)
    assert again["rows"] == m["rows"] and again["training"] == m["training"]
    assert json.dumps(again["sizes"]) == json.dumps(m["sizes"])  # NaN where a test is undefined
    (packed / "seed0" / "softmax" / "eval_minimum_n2_p6.json").unlink()
    _, third = cl.run(packed, cfg, net=net, tok=tok)  # trains seed 0's softmax again
    assert third["rows"] == m["rows"]
    assert (packed / "seed0" / "softmax" / "model.safetensors").is_file()


def test_more_evaluation_sizes_and_more_adaptive_steps(tmp_path):
    """``eval_sizes`` adds sizes (here 4, between the training range and 6) and may be asked of
    an existing run, which evaluates only the new size; ``adaptive_steps`` trains adaptive
    longer (part of the run's identity: a folder of the other value is refused), and the
    report states the in-distribution gap over seeds beside it."""
    net, tok = tiny_hf.pretrained()
    cfg = _cfg(steps=4, seeds=2, adaptive_steps=6)
    assert cfg.sizes == [2, 3, 6] and _cfg(eval_sizes=(4,)).sizes == [2, 3, 4, 6]
    assert (cfg.steps_of("softmax"), cfg.steps_of("adaptive")) == (4, 6)
    run, m = cl.run(tmp_path / "r", cfg, net=net, tok=tok)
    assert m["training"]["adaptive seed 0"]["steps_per_s"] > 0
    log = (run / "seed0" / "adaptive" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(log[-1])["step"] == 6
    report = (run / "report.md").read_text()
    assert "(6 for adaptive temperature)" in report and "In distribution" in report
    inside = cl.in_distribution(m["rows"], cfg)
    assert set(inside) == {"minimum", "binary_search"} and inside["minimum"].n == 2
    more = replace(cfg, eval_sizes=(4,))
    _, m2 = cl.run(tmp_path / "r", more, net=net, tok=tok)
    assert {r["size"] for r in m2["rows"]} == {2, 3, 4, 6}
    with pytest.raises(ValueError, match="adaptive_steps"):
        cl.run(tmp_path / "r", replace(cfg, adaptive_steps=8), net=net, tok=tok)
    # the seed count is fixed when the folder is made: a verdict over seeds is over those planned
    with pytest.raises(ValueError, match="seeds"):
        cl.run(tmp_path / "r", replace(cfg, seeds=3), net=net, tok=tok)
    assert not (run / "seed2").exists()
    with pytest.raises(ValueError, match="eval_sizes"):
        _cfg(eval_sizes=(0,))
