"""Selective temperatures fine-tuned on a frozen decoder (``reproduce selective-llm``), on a tiny
random Llama: the identity at initialisation, a frozen base, resume after an interruption with
the numbers of an uninterrupted run, and one-sentence errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_hf
from processes import kill_9_once_written, sharpattn
from sharpattn.cli import main
from sharpattn.experiments import selective_llm as sl
from sharpattn.integrations import pretrained
from sharpattn.lab.runner import Trainer


def _net():
    torch.manual_seed(0)
    return tiny_hf.llama().eval()


def _ids(n: int = 800) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # a repeating pattern with noise: something the temperatures can lower the loss on
    base = torch.arange(n) % 13 + 3
    noise = torch.randint(3, 97, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.2, noise, base)


def _cfg(**kw) -> sl.Config:
    return sl.Config(
        **{
            "steps": 6,
            "context": 8,
            "factors": (1, 2, 4),
            "batch": 2,
            "lr": 3e-2,
            "eval_windows": 3,
            "checkpoint_every": 2,
            "threads": 1,
            **kw,
        }
    )


def test_fine_tunes_only_the_temperatures_from_an_identity(tmp_path):
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    run, m = sl.run(tmp_path / "r", _cfg(), net=net, ids=_ids())
    # τ = 1 + c₀·log n with c₀ = e^{−e^{2.5}} ≈ 5.1e-6 and n ≤ 8: q and v move by a relative
    # 1.1e-5 at most, so the NLL (O(1) logits of a random model) moves by ~1e-5; float32
    # rounding of the two forward passes is ~1e-6
    assert abs(m["step0_nll_change"]) < 1e-4
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base stayed frozen
    assert m["trainable_parameters"] > 0 and m["model_parameters"] == sum(
        v.numel() for v in before.values()
    )
    assert [r["length"] for r in m["rows"]] == [8, 16, 32]
    for r in m["rows"]:
        assert r["windows"] == 3 and r["ppl_base"] > 1 and r["ppl_selective"] > 1
    losses = [r["loss"] for r in m["training_curve"]]
    assert len(losses) >= 2 and all(torch.isfinite(torch.tensor(x)).all() for x in losses)
    for name in ("report.md", "table3_small.md", "table3_small.csv", "perplexity.png"):
        assert (run / name).is_file()


def test_the_position_only_control_trains_one_coefficient_per_head(tmp_path):
    from sharpattn.attention.selective import initial_theta, position_coefficient

    _, m = sl.run(tmp_path / "p", _cfg(terms="position"), net=_net(), ids=_ids())
    # tiny_hf.llama: 2 layers, 4 query heads, 2 key/value heads
    assert m["trainable_parameters"] == 2 * (4 + 2)
    c0 = float(position_coefficient(torch.tensor(initial_theta("exp")), "exp"))
    moved = [abs(c / c0 - 1) for cs in m["position_coefficient"].values() for c in cs]
    # 6 Adam steps at 3e-2 move β by up to 0.18, so c = e^{−e^β} by up to a factor e^{±2}
    assert max(moved) > 0.1


def test_an_interrupted_run_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, monkeypatch):
    _, whole = sl.run(tmp_path / "whole", _cfg(), net=_net(), ids=_ids())

    class Interrupted(Trainer):  # Ctrl-C during step 4: the Trainer checkpoints step 3
        def __init__(self, *a, batch, **kw):
            def stop(step):
                if step == 3:
                    raise KeyboardInterrupt
                return batch(step)

            super().__init__(*a, batch=stop, **kw)

    monkeypatch.setattr(sl, "Trainer", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        sl.run(tmp_path / "cut", _cfg(), net=_net(), ids=_ids())
    assert (tmp_path / "cut" / "train" / "checkpoint.safetensors").is_file()
    monkeypatch.setattr(sl, "Trainer", Trainer)
    _, resumed = sl.run(tmp_path / "cut", _cfg(), net=_net(), ids=_ids())
    assert resumed["rows"] == whole["rows"]
    assert resumed["position_coefficient"] == whole["position_coefficient"]
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "cut" / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(set(steps))  # no step logged twice after the resume


def test_bad_configurations_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(ValueError, match="beyond the model's context"):
        sl.run(tmp_path / "a", _cfg(context=32), net=_net(), ids=_ids(2000))
    with pytest.raises(ValueError, match="held-out text has"):
        sl.run(tmp_path / "b", _cfg(eval_windows=50), net=_net(), ids=_ids())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
    with pytest.raises(ValueError, match="targets"):
        _cfg(targets="qx")
    with pytest.raises(ValueError, match="lr"):
        _cfg(lr=float("nan"))
    with pytest.raises(ValueError, match="position_lr"):
        _cfg(position_lr=0.0)
    with pytest.raises(ValueError, match="terms"):
        _cfg(terms="all")
    with pytest.raises(ValueError, match="unknown profile"):
        sl.make_config("huge")


#: the command on tests/tiny_hf.py's Llama (tiny_hf.pretrained), one thread, 16-token windows
CLI = [
    "reproduce",
    "selective-llm",
    "--quick",
    "--eval-windows",
    "1",
    "--context",
    "16",
    "--threads",
    "1",
]


def _untimed(metrics: dict) -> dict:
    timing = ("train_seconds", "train_steps_per_s", "wall_seconds", "cpu_seconds")
    return {k: v for k, v in metrics.items() if k not in timing}


def _same_run(a: Path, b: Path) -> None:
    """Two run folders hold the same numbers: metrics, training log and trained temperatures."""
    ma, mb = (json.loads((p / "metrics.json").read_text()) for p in (a, b))
    assert _untimed(ma) == _untimed(mb)
    logs = [(p / "train" / "metrics.jsonl").read_text() for p in (a, b)]
    assert logs[0] == logs[1]
    ta, tb = (load_file(p / "train" / "model.safetensors") for p in (a, b))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_two_runs_give_the_same_numbers_whatever_the_global_generator(tmp_path, monkeypatch):
    """The temperatures are initialised from the run's seed, not from torch's global generator
    (here in two different states, as after two different model loads)."""
    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
    for i in (1, 2):
        torch.manual_seed(i)
        assert main([*CLI, "--steps", "4", "--out", str(tmp_path / f"r{i}")]) == 0
    _same_run(tmp_path / "r1", tmp_path / "r2")


def test_a_run_killed_with_sigkill_resumes_to_the_numbers_of_an_uninterrupted_one(
    tmp_path, monkeypatch
):
    """A real ``kill -9`` of the command after its first checkpoint (step 50), then the command
    again and an uninterrupted run (in this process): the child's global generator starts in an
    arbitrary state, this process's in another."""
    args = [*CLI, "--steps", "200"]
    killed = sharpattn(*args, "--out", str(tmp_path / "killed"), tiny_pretrained=True)
    kill_9_once_written(killed, tmp_path / "killed" / "train" / "checkpoint.safetensors")
    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
    for i, out in enumerate(("killed", "whole")):
        torch.manual_seed(i)
        assert main([*args, "--out", str(tmp_path / out)]) == 0
    _same_run(tmp_path / "killed", tmp_path / "whole")


def test_quick_then_paper_in_one_folder_evaluates_the_new_lengths(tmp_path, monkeypatch):
    """The evaluations are stored per length and window count: a later invocation asking for
    more lengths computes those and reuses the rest."""
    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
    out = ["--steps", "2", "--out", str(tmp_path)]
    assert main([*CLI, *out]) == 0
    assert main([*CLI[:2], "--paper", *CLI[3:], *out]) == 0
    rows = json.loads((tmp_path / "metrics.json").read_text())["rows"]
    assert [r["length"] for r in rows] == [16, 32, 64]
