"""`sharpattn reproduce selective` on the runner: an interrupted run, re-run, ends with exactly the
numbers of an uninterrupted one (same batches, same order of operations, one CPU thread), and a
folder of another configuration is refused in one sentence."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sharpattn.cli import main
from sharpattn.experiments import selective as exp
from sharpattn.experiments.selective_denoise import DenoiseConfig
from sharpattn.experiments.selective_graph import GraphConfig
from sharpattn.experiments.selective_lm import LMConfig

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
SRC = Path(exp.__file__).resolve().parents[2]  # the checkout's src/, for the subprocess
TIMING = {"seconds", "graph_seconds", "denoise_seconds", "lm_seconds", "train_seconds"}
TABLES = ("graph.md", "denoise.md", "lm.md", "overhead.md")


def tiny(**kw) -> exp.ReproduceConfig:
    lm = LMConfig(
        layers=1,
        d_model=32,
        n_heads=2,
        context=32,
        eval_contexts=(32, 64),
        steps=8,
        batch=4,
        warmup=2,
        seeds=1,
        eval_tokens=256,
        text=str(CORPUS),
        variants=("vanilla", "qv · both"),
    )
    return exp.ReproduceConfig(
        graph=GraphConfig(steps=12, batch=16, lr=1e-2, seeds=2),
        denoise=DenoiseConfig(
            steps=10, batch=8, lr=1e-2, seeds=2, sigmas=(0.2, 0.4), main_sigma=0.2, eval_samples=64
        ),
        lm=lm,
        checkpoint_every=3,
        **kw,
    )


def untimed(obj):
    """``obj`` without wall-clock fields (they differ between any two runs)."""
    if isinstance(obj, dict):
        return {k: untimed(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [untimed(v) for v in obj]
    return obj


def assert_same_run(a: Path, b: Path, tables=TABLES) -> None:
    """Tables, metrics and every trained tensor and training log of two run folders are equal."""
    for name in tables:
        assert (a / name).read_text() == (b / name).read_text(), name
    ma, mb = (json.loads((p / "metrics.json").read_text()) for p in (a, b))
    assert untimed(ma) == untimed(mb)
    weights = sorted(p.relative_to(a) for p in a.rglob("model.safetensors"))
    assert weights and weights == sorted(p.relative_to(b) for p in b.rglob("model.safetensors"))
    for w in weights:
        ta, tb = load_file(a / w), load_file(b / w)
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), w  # bitwise: same ops, one thread
        logs = [(p / w.parent / "metrics.jsonl").read_text() for p in (a, b)]
        assert logs[0] == logs[1], w
    assert not list(b.rglob("checkpoint.safetensors"))  # finished runs keep no checkpoint


def test_interrupted_run_resumes_to_the_same_numbers(tmp_path):
    config = tiny()
    whole, result = exp.run(tmp_path / "whole", config)
    assert result is not None and [r["variant"] for r in result["lm"]] == ["vanilla", "qv · both"]

    out = tmp_path / "interrupted"
    # each part stopped after 5 steps (its last checkpoint is at step 3) as by a crash, then
    # resumed: graph alone, then denoising after a finished graph, then the first LM run
    for part, tasks in (("graph", ("graph",)), ("denoise", ("graph", "denoise")), ("lm", None)):
        staged = replace(config, tasks=tasks or config.tasks)
        _, stopped = exp.run(out, staged, stop_at=5)
        assert stopped is None
        [log] = (out / part).rglob("metrics.jsonl")  # the stopped part's log, nothing after it
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
        assert steps == (list(range(6)) if part == "lm" else [0])  # the LM logs every step
        assert (log.parent / "checkpoint.safetensors").is_file()
        assert not (log.parent / "model.safetensors").exists()
        _, result = exp.run(out, staged)
        assert result is not None
    assert_same_run(whole, out)


def test_a_folder_of_another_configuration_is_refused(tmp_path):
    config = tiny(tasks=("graph",))
    exp.run(tmp_path, config, stop_at=2)
    other = replace(config, graph=replace(config.graph, lr=3e-2))
    with pytest.raises(ValueError) as err:
        exp.run(tmp_path, other)
    message = str(err.value)
    assert "graph.lr (0.01 there, 0.03 now)" in message and "--out" in message
    assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")
    # settings that do not change what is trained may change: threads, tasks, LM variants
    more = replace(config, threads=2, lm=replace(config.lm, variants=("vanilla",)))
    _, result = exp.run(tmp_path, more)
    assert result is not None and "graph" in result
    # another experiment's folder: refused too
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"experiment": "max-retrieval"}')
    with pytest.raises(ValueError, match="not a reproduce selective run"):
        exp.run(tmp_path / "other", config)
    # through the CLI: one line on stderr, exit code 2
    argv = ["reproduce", "selective", "--quick", "--tasks", "graph", "--out", str(tmp_path)]
    assert main(argv) == 2


def _cli(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from sharpattn.cli import main; sys.exit(main())",
        "reproduce",
        "selective",
        "--quick",
        "--tasks",
        "graph",
        "--seeds",
        "2",
        "--steps",
        "300",
        "--checkpoint-every",
        "25",
        "--out",
        str(out),
        *extra,
    ]


def test_kill_9_then_rerun_finishes_with_the_same_numbers(tmp_path):
    """A real `kill -9` of the command mid-training, then the same command again."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = tmp_path / "killed"
    checkpoint = out / "graph" / "classifier" / "checkpoint.safetensors"
    proc = subprocess.Popen(_cli(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert checkpoint.is_file(), proc.stderr.read().decode() if proc.poll() else "no checkpoint"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "graph" / "classifier" / "model.safetensors").exists()  # killed mid-run
    done = subprocess.run(_cli(out), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    whole = tmp_path / "whole"
    done = subprocess.run(_cli(whole), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert_same_run(whole, out, tables=("graph.md",))
