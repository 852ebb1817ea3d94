"""Bigram-Backcopy experiment: measures by hand, a tiny training run, resume after a crash."""

import json
import math
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from precision import assert_close
from reference import transformer_internals
from sharpattn.experiments import backcopy as bb
from sharpattn.lab.runner import RunFolder
from sharpattn.models.transformer import Transformer
from sharpattn.tasks.bigram_backcopy import KIND_BACKCOPY, KIND_BIGRAM, BigramBackcopy


@pytest.fixture(scope="module")
def task():
    return BigramBackcopy.tiny_shakespeare()


# tiny models: many small ops, which two threads slow down badly on a shared 2-core machine
pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


def tiny(**kw):
    base = dict(
        d_model=32,
        seq_len=24,
        batch=16,
        steps=8,
        eval_batch=4,
        n_measure=4,
        checkpoint_every=2,
        lr=3e-3,
    )
    base.update(kw)
    return bb.RunConfig(**base)


@pytest.mark.parametrize("method", ["softmax", "relu"])
def test_measure_equals_a_direct_computation(task, method):
    """measure() on a two-layer model (+ an MLP-only layer) against float64 NumPy from the
    model's own weights: norms, drains, peaks, sink mass, Δlogit, weights by kind of query."""
    cfg = tiny(layers="tf,tf,mlp", method=method)
    torch.manual_seed(0)
    model = Transformer(cfg.model_config(task)).double()
    for p in model.parameters():  # away from the near-uniform initialisation
        p.data.add_(0.3 * torch.randn_like(p))
    x = task.sample(3, cfg.seq_len, seed=5)
    got = bb.measure(model, task, x)
    ref, _ = transformer_internals(model, x)
    kind = task.position_kind(x).numpy()
    bigram = kind == KIND_BIGRAM
    copy = kind == KIND_BACKCOPY
    assert not bigram[:, 0].any()  # position 0 is BOS
    t = x.shape[1]

    def close_measure(value, expect):
        # a float64 model of width 32 and 3 layers (MLP 4·32) against NumPy; capture computes value
        # norms in float32, and every measure is a mean over at most 3·24 positions of them
        assert_close(value, expect, dtype=torch.float32, n=32 * 128)

    for i, rec in ref.items():
        pre = f"layers.{i}"
        res = np.linalg.norm(rec["resid_post"], axis=-1)  # (B, T)
        close_measure(got[f"{pre}.res_bos"], res[:, 0].mean())
        close_measure(got[f"{pre}.res_other"], res[:, 1:].mean())
        ratio = res[:, 0] / res[:, 1:].mean(-1)
        close_measure(got[f"{pre}.res_ratio"], ratio.mean())
        if "weights" not in rec:
            assert f"{pre}.attn.val_bos" not in got
            continue
        val = np.linalg.norm(rec["values"], axis=-1)  # (B, H, T)
        close_measure(got[f"{pre}.attn.val_bos"], val[..., 0].mean())
        close_measure(got[f"{pre}.attn.val_other"], val[..., 1:].mean())
        drain = val[..., 0] / val[..., 1:].mean(-1)
        close_measure(got[f"{pre}.attn.val_drain"], drain.mean())
        w = rec["weights"].mean(1)  # (B, T, T), mean over heads
        sink = (rec["weights"][..., 0]).mean()  # every query i >= 0 sees BOS
        close_measure(got[f"{pre}.attn.bos_sink_mass"], sink)
        close_measure(got[f"{pre}.attn.bos_weight"], w[..., 0][bigram].mean())
        prev = np.zeros_like(w[..., 0])
        prev[:, 1:] = w[:, np.arange(1, t), np.arange(t - 1)]
        close_measure(got[f"{pre}.attn.prev_weight_trigger"], prev[copy].mean())
        s = rec["scores"]
        dl = []
        for bi, n in zip(*np.nonzero(bigram), strict=True):
            row = s[bi, :, n]  # (H, T)
            dl.append((row[:, 0] - row[:, 1 : n + 1].mean(-1)).mean())
        close_measure(got[f"{pre}.attn.delta_logit"], np.mean(dl))


def test_log_steps():
    assert bb.log_steps(10_000, 5) == [0, 1, 10, 100, 1000, 10_000]
    assert bb.log_steps(7, 30)[-1] == 7 and bb.log_steps(7, 30)[0] == 0


def test_a_tiny_run_learns(task, tmp_path):
    cfg = tiny(steps=60, n_measure=6, batch=32)
    run = bb.train(tmp_path / "run", cfg, task)
    first, last = run.metrics[0], run.metrics[-1]
    assert run.steps_done == 60 and run.seconds > 0
    assert last["bigram_excess"] < 0.7 * first["bigram_excess"]
    assert last["backcopy_excess"] < first["backcopy_excess"]
    assert "layers.0.attn.delta_logit" in last and "layers.0.res_peak" in last
    # measured at the log-spaced steps only (the Trainer's log_at), read back from metrics.jsonl
    assert [m["step"] for m in run.metrics] == bb.log_steps(60, 6)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == run.metrics
    again = bb.train(tmp_path / "run", cfg, task)  # a finished run is loaded, not retrained
    assert again.metrics == run.metrics and again.seconds == run.seconds


def assert_same_run(a, b):
    for (n, p), (_, q) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), n
    assert a.steps_done == b.steps_done
    assert a.metrics == b.metrics  # every measure at every logged step, exactly


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_gives_the_same_run(task, tmp_path, optimizer):
    cfg = tiny(optimizer=optimizer, layers="tf,tf", lr=None)
    straight = bb.train(tmp_path / "a", cfg, task)
    part = bb.train(tmp_path / "b", cfg, task, stop_at=3)  # stops after step 3: checkpoint at 2
    assert part.steps_done == 3 and not (tmp_path / "b" / "model.safetensors").exists()
    resumed = bb.train(tmp_path / "b", cfg, task)
    assert_same_run(resumed, straight)


# Kills its own process (SIGKILL: no handler, no cleanup) in the middle of the 6th AdamW step,
# after the checkpoint of step 4 and with metrics.jsonl holding a record of step 5.
_KILLED = """
import json, os, signal, sys, torch
from sharpattn.experiments import backcopy as bb
from sharpattn.lab.runner import RunFolder
torch.set_num_threads(1)
calls, step = [0], torch.optim.AdamW.step
def dying(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)
torch.optim.AdamW.step = dying
bb.train(sys.argv[1], bb.RunConfig(**json.loads(sys.argv[2])))
"""


@pytest.mark.cpu_independent
def test_a_run_killed_mid_step_resumes_to_the_same_numbers(task, tmp_path):
    cfg = tiny(steps=9, n_measure=9, checkpoint_every=4)
    args = [str(tmp_path / "killed"), json.dumps(cfg.to_dict())]
    proc = subprocess.run([sys.executable, "-c", _KILLED, *args], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert (tmp_path / "killed" / "checkpoint.safetensors").exists()
    logged = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").open()]
    assert max(logged) == 5  # measured after the checkpoint: dropped on resume, measured again
    resumed = bb.train(tmp_path / "killed", cfg, task)
    assert_same_run(resumed, bb.train(tmp_path / "straight", cfg, task))


def test_a_folder_with_another_config_is_refused(task, tmp_path):
    bb.train(tmp_path / "r", tiny(steps=2), task)
    with pytest.raises(ValueError, match=r"different steps \(2 there, 3 now\)") as err:
        bb.train(tmp_path / "r", tiny(steps=3), task)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
    bb.train(tmp_path / "r", tiny(steps=2, checkpoint_every=5), task)  # not part of the run


def test_a_reproduction_folder_of_another_seed_is_refused(tmp_path):
    bb.open_folder(tmp_path / "r", "quick", seed=0)
    with pytest.raises(ValueError, match=r"different seed \(0 there, 1 now\)"):
        bb.reproduce(tmp_path / "r", profile="quick", seed=1)  # before any training
    assert not (tmp_path / "r" / "runs").exists()
    RunFolder(tmp_path / "m", "max-retrieval", {})
    with pytest.raises(ValueError, match="holds a max-retrieval run, not a backcopy run"):
        bb.open_folder(tmp_path / "m", "quick", seed=0)


def test_config_errors():
    with pytest.raises(ValueError, match="optimizer"):
        bb.RunConfig(optimizer="lion")
    with pytest.raises(ValueError, match="batch"):
        bb.RunConfig(batch=0)
    with pytest.raises(ValueError, match="profile"):
        bb.profile_config("huge", "1L-softmax-adam")
    assert bb.RunConfig(optimizer="sgd").learning_rate == 0.03
    assert bb.profile_config("paper", "3L-softmax-sgd").learning_rate == 0.03


def test_interventions_rows(task):
    torch.manual_seed(0)
    cfg = tiny(layers="tf,tf")
    from sharpattn.models.transformer import Transformer

    m = Transformer(cfg.model_config(task))
    rows = bb.interventions(m, task, task.sample(4, 24, seed=0))
    assert [r["zeroed"] for r in rows] == ["none", *m.sublayers]


def test_linear_fit_of_the_findings():
    from sharpattn.lab.stats import linear_fit

    x = np.log(np.array([10.0, 20, 50, 100, 200]))
    y = 2.0 * x + 1 + np.array([0.1, -0.1, 0.05, 0.0, -0.05])
    slope, r2 = linear_fit(x, y)
    assert_close(slope, np.polyfit(x, y, 1)[0], dtype=torch.float64, n=5)
    assert 0.99 < r2 < 1
    assert all(math.isnan(v) for v in linear_fit([1.0, 2.0], [3.0, 4.0]))  # < 3 points
    assert linear_fit([1.0, 2, 3], [5.0, 5, 5])[0] == 0 and math.isnan(
        linear_fit([1, 2, 3], [5] * 3)[1]
    )


@pytest.mark.cpu_independent
def test_runs_trained_in_a_process_pool_longest_first_give_the_sequential_numbers(
    task, tmp_path, monkeypatch
):
    from sharpattn.lab import sweep

    cfgs = {"short": tiny(steps=4), "deep": tiny(layers="tf+tf", steps=4), "long": tiny(steps=6)}
    order = []
    real = sweep.run_jobs
    monkeypatch.setattr(
        sweep,
        "run_jobs",
        lambda fn, jobs, **kw: order.extend(j[1] for j in jobs) or real(fn, jobs, **kw),
    )
    folder = RunFolder(tmp_path / "p", "backcopy", {})
    bb.train_runs(folder, cfgs, task, threads=1, workers=2)
    assert order == ["deep", "long", "short"]  # by blocks × steps × batch × tokens × width
    for name, cfg in cfgs.items():
        pooled = bb.train(tmp_path / "p" / "runs" / name, cfg, task)  # loads: nothing to train
        alone = bb.train(tmp_path / "s" / name, cfg, task)
        assert pooled.steps_done == alone.steps_done == cfg.steps
        assert pooled.metrics == alone.metrics
    before = len(order)
    bb.train_runs(folder, cfgs, task, threads=1, workers=1)  # one worker: the caller trains
    assert len(order) == before
