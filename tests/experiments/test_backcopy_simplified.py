"""App. C.3 of Guo et al. (issue 15, item 7): the simplified model of Theorem 2 trained by Adam
(`sharpattn.experiments.backcopy.simplified`, `sharpattn reproduce backcopy-study simplified`)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precision import assert_close
from sharpattn.cli import main
from sharpattn.experiments.backcopy import simplified as bsm
from sharpattn.experiments.backcopy import simplified_model as bsmm
from sharpattn.experiments.backcopy import studies as bs
from sharpattn.lab import runner
from sharpattn.tasks.bigram_backcopy import KIND_BIGRAM, BigramBackcopy

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def task():
    return BigramBackcopy.tiny_shakespeare()


def small_task(v=6, n_triggers=2, seed=0):
    rng = np.random.default_rng(seed)
    counts = {
        "chars": [chr(ord("a") + i) for i in range(v)],
        "unigram_counts": sorted(rng.integers(10, 100, v).tolist(), reverse=True),
        "bigram_counts": rng.integers(1, 20, (v, v)).tolist(),
    }
    return BigramBackcopy.from_counts(counts, n_triggers)


def random_model(task, hidden=5, seed=0, logit_shift=0.0):
    """Every parameter N(0, 1) (α and λ shifted by ``logit_shift``: large attention logits)."""
    m = bsmm.SimplifiedModel(task.V, task.n_triggers, hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        m.alpha.add_(logit_shift)
        m.lam.add_(logit_shift)
    return m


def np_forward(m, x):
    """Fig. 5 / Eqs. (6)-(8) with App. C.3's MLP and O·β, one query at a time in float64: the
    logits of every key, a softmax over keys 0..n, the weighted sum of the value vectors."""
    p = {k: v.detach().double().numpy() for k, v in m.named_parameters()}
    v_, nt = m.V, m.n_triggers
    x = x.numpy()
    b_, t_ = x.shape
    out, weights = np.zeros((b_, t_, v_)), np.zeros((b_, t_, t_))
    eye = np.eye(v_)
    for b in range(b_):
        for n in range(t_):
            tok = x[b, n]
            s = np.zeros(n + 1)  # keys 0 (BOS) .. n
            if nt <= tok < v_:
                s[0] = p["alpha"][tok]  # Eq. (6), non-trigger query: α on BOS
            if tok < nt and n >= 2:
                s[n - 1] = p["lam"]  # trigger query: λ on the previous token
            w = np.exp(s - s.max())
            w /= w.sum()
            vals = [p["O"] @ p["beta"]]  # Val_BOS = O·β
            vals += [(p["xi"][k] if k >= nt else 0.0) * eye[k] for k in x[b, 1 : n + 1]]
            mlp = p["mlp.2.weight"] @ np.maximum(p["mlp.0.weight"][:, tok], 0.0)
            out[b, n] = mlp + sum(wi * vi for wi, vi in zip(w, vals, strict=True))
            weights[b, n, : n + 1] = w
    return out, weights


@pytest.mark.parametrize("logit_shift", [0.0, 90.0])
def test_forward_matches_a_float64_numpy_transcription(logit_shift):
    task = small_task()
    m = random_model(task, logit_shift=logit_shift)
    x = task.sample(3, 12, seed=1)
    assert bool((x < task.n_triggers).any())  # trigger queries are exercised
    want, w_want = np_forward(m, x)
    # float32 results of reductions over at most max(T, hidden, V) = 12 terms (the keys, the
    # MLP's hidden units, O·β's V products); absolute error ≲ 8 ulps · √12 · the size of the
    # summed terms: max |W₂|·|W₁| summed over hidden units, |O|·|β| summed over V, max |ξ|.
    # Logits near 90 (exp(90) overflows float32 unshifted) are subtracted exactly from the
    # row maximum, so they do not widen the bound.
    p = {k: v.detach().double().numpy() for k, v in m.named_parameters()}
    mag = max(
        (np.abs(p["mlp.2.weight"]) @ np.abs(p["mlp.0.weight"])).max(),
        (np.abs(p["O"]) @ np.abs(p["beta"])).max(),
        np.abs(p["xi"]).max(),
    )
    n = max(x.shape[1], 5, task.V)
    with torch.no_grad():
        assert_close(m(x), want, n=n, magnitude=mag)
        assert_close(m.forward_explicit(x), want, n=n, magnitude=mag)
        assert_close(torch.softmax(m.scores(x), -1), w_want, n=x.shape[1], magnitude=1.0)
        norms = m.value_norms(x)
    assert_close(norms[:, 0], np.linalg.norm(p["O"] @ p["beta"]), n=task.V)
    xi_masked = np.where(np.arange(task.V) >= task.n_triggers, np.abs(p["xi"]), 0.0)
    assert_close(norms[:, 1:], xi_masked[x[:, 1:].numpy()], n=1)


def test_fused_loss_gradient_against_finite_differences():
    # the hand-written gradient of _NextTokenLoss, in float64, against torch's central
    # differences (gradcheck), with chunks that split the batch unevenly
    task = small_task()
    x = task.sample(3, 9, seed=2)
    inp, target = x[:, :-1], x[:, 1:]
    g = torch.Generator().manual_seed(3)
    args = [
        torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
        for s in ((task.V + 1, task.V), (task.V,), (task.V,), inp.shape, inp.shape, inp.shape)
    ]
    assert torch.autograd.gradcheck(
        lambda *a: bsmm._NextTokenLoss.apply(*a, inp, target, 2), args, eps=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_loss_equals_autograd_through_forward(task, dtype):
    m = random_model(task, hidden=16, seed=4).to(dtype)
    x = task.sample(5, 21, seed=5)
    ref = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    want = torch.autograd.grad(ref, list(m.parameters()))
    got_loss = m.loss(x, chunk=2)
    got = torch.autograd.grad(got_loss, list(m.parameters()))
    # a mean over B·T = 100 positions of a V = 64-way log-softmax; gradients are sums over the
    # same positions: 8 ulps · √100 of the loss (resp. of the largest gradient entry)
    assert_close(got_loss, ref, n=100, magnitude=float(ref.detach().abs()))
    for (name, _), a, b in zip(m.named_parameters(), got, want, strict=True):
        assert_close(a, b, n=100, magnitude=float(b.abs().max()), msg=name)


def test_measures_on_the_evaluation_sequences(task):
    m = random_model(task, hidden=8, seed=6)
    x = task.sample(4, 20, seed=7)
    got = bsm.measure(m, task, x)
    p = {k: v.detach().double().numpy() for k, v in m.named_parameters()}
    _, w = np_forward(m, x)
    q = (task.position_kind(x) == KIND_BIGRAM).numpy()
    q[:, 0] = False
    # Δlogit at a non-trigger query = α of its token (every other logit is 0)
    assert_close(got["delta_logit"], p["alpha"][x.numpy()[q]].mean(), dtype=torch.float32, n=80)
    assert_close(got["bos_weight"], w[..., 0][q].mean(), dtype=torch.float32, n=80)
    assert_close(got["val_bos"], np.linalg.norm(p["O"] @ p["beta"]), dtype=torch.float32, n=64)
    assert got["alpha"] == [float(a) for a in m.alpha.detach()]
    nt = p["alpha"][task.n_triggers :]
    assert got["alpha_q05"] <= got["alpha_mean"] <= got["alpha_q95"]
    assert_close(got["alpha_mean"], nt.mean(), dtype=torch.float64, n=64)
    for k in ("bigram_excess", "backcopy_excess"):
        assert got[k] >= -1e-6


def tiny(**changes):
    cfg = dict(
        steps=9,
        batch=4,
        seq_len=12,
        hidden=8,
        eval_batch=4,
        linear_until=4,
        linear_every=2,
        n_log=3,
        checkpoint_every=4,
    )
    return bsm.SimplifiedConfig(**{**cfg, **changes})


def assert_same_run(a, b):
    for (n, p), (_, q) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), n
    assert a.steps_done == b.steps_done and a.metrics == b.metrics


def test_a_run_logs_fig18s_axis_and_resumes_to_the_same_numbers(task, tmp_path):
    cfg = tiny()
    straight = bsm.train(tmp_path / "a", cfg, task)
    assert [m["step"] for m in straight.metrics] == runner.log_steps(9, 3, 4, 2) == [0, 2, 4, 6, 9]
    part = bsm.train(tmp_path / "b", cfg, task, stop_at=6)  # a crash after step 6: checkpoint 4
    assert part.steps_done == 6 and not (tmp_path / "b" / "model.safetensors").exists()
    assert_same_run(bsm.train(tmp_path / "b", cfg, task), straight)
    again = bsm.train(tmp_path / "a", cfg, task)  # a finished run is loaded, not retrained
    assert again.metrics == straight.metrics and again.seconds == straight.seconds
    with pytest.raises(ValueError, match=r"different steps \(9 there, 10 now\)"):
        bsm.train(tmp_path / "a", tiny(steps=10), task)


# Kills its own process (SIGKILL: no handler, no cleanup) inside the 7th AdamW step, after the
# checkpoint of step 4 and with metrics.jsonl holding the record of step 6.
_KILLED = """
import json, os, signal, sys, torch
from sharpattn.experiments.backcopy import simplified as bsm
torch.set_num_threads(1)
calls, step = [0], torch.optim.AdamW.step
def dying(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)
torch.optim.AdamW.step = dying
bsm.train(sys.argv[1], bsm.SimplifiedConfig(**json.loads(sys.argv[2])))
"""


@pytest.mark.cpu_independent
def test_a_run_killed_mid_step_resumes_to_the_same_numbers(task, tmp_path):
    cfg = tiny()
    args = [str(tmp_path / "killed"), json.dumps(cfg.to_dict())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, *args], capture_output=True, timeout=300, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert (tmp_path / "killed" / "checkpoint.safetensors").exists()
    logged = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").open()]
    assert max(logged) == 6  # measured after the checkpoint: dropped on resume, measured again
    resumed = bsm.train(tmp_path / "killed", cfg, task)
    assert_same_run(resumed, bsm.train(tmp_path / "straight", cfg, task))


def test_the_study_writes_its_report_and_resumes(task, tmp_path):
    path, res = bsm.run(tmp_path / "s", seeds=2, task=task, base=tiny())
    text = (path / "report.md").read_text()
    assert "App. C.3" in text and "seed1" in text and "Log fit" in text
    assert (path / "dynamics.png").is_file() and (path / "statics.png").is_file()
    s0 = res["runs"]["seed0"]
    assert s0["steps"] == 9 and s0["log_fit"]["points"] == 3  # steps 4, 6, 9
    # nothing measured from step 1,000 on: None, not NaN (results.json stays strict JSON)
    assert s0["log_fit_late"]["slope"] is None and s0["max_excess_late"] == [None, None]
    json.loads((path / "results.json").read_text(), parse_constant=pytest.fail)
    run = bsm.train(tmp_path / "s" / "runs" / "seed0", tiny(), task)
    assert s0["delta_logit"] == run.metrics[-1]["delta_logit"]
    assert json.loads((path / "results.json").read_text())["runs"]["seed0"] == s0
    _, again = bsm.run(tmp_path / "s", seeds=2, task=task, base=tiny())  # loaded, not retrained
    assert again["runs"] == res["runs"]


def test_log_fit_and_convergence_by_hand():
    t = np.array([0, 100, 400, 800, 1600, 3200])
    y = 0.5 * np.log(np.maximum(t, 1)) + 2.0
    metrics = [
        {"step": int(s), "delta_logit": float(v), "bigram_excess": e, "backcopy_excess": c}
        for s, v, e, c in zip(
            t, y, [1, 0.05, 0.01, 0.01, 0.01, 0.01], [2, 0.5, 0.2, 0.05, 0.01, 0.01], strict=True
        )
    ]
    fit = bsm.log_fit(metrics, start=400)
    assert fit["points"] == 4 and fit["from"] == 400
    assert_close(fit["slope"], 0.5, dtype=torch.float64, n=4)
    assert_close(fit["intercept"], 2.0, dtype=torch.float64, n=4, magnitude=10)
    assert_close(fit["r2"], 1.0, dtype=torch.float64, n=4)
    assert fit["r2_linear_in_t"] < 0.99
    assert bsm.converged_steps(metrics) == {"bigram": 100, "backcopy": 800, "both": 800}


def test_log_steps_linear_then_log():
    steps = runner.log_steps(5000, 10, linear_until=400, linear_every=100)
    assert steps[:5] == [0, 100, 200, 300, 400] and steps[-1] == 5000
    after = np.array(steps[4:], dtype=float)
    ratios = after[1:] / after[:-1]
    assert np.ptp(ratios) < 0.01  # log-spaced after the knee
    assert runner.log_steps(300, 5, 400, 100) == [0, 100, 200, 300]
    with pytest.raises(ValueError, match="linear_every >= 1"):
        runner.log_steps(10, 3, 4, 0)


def test_bad_settings_are_one_sentence():
    for kw, words in (
        ({"steps": 0}, "steps must be >= 1"),
        ({"seq_len": 2}, "seq_len"),
        ({"lr": 0.0}, "lr > 0"),
    ):
        with pytest.raises(ValueError, match=words) as err:
            bsm.SimplifiedConfig(**kw)
        assert str(err.value).endswith(".") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="n_triggers < V"):
        bsmm.SimplifiedModel(4, 4)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["reproduce", "backcopy-study", "sgd", "--steps", "10"],
            "--steps applies to the simplified",
        ),
        (["reproduce", "backcopy-study", "simplified", "--steps", "0"], "--steps"),
        (["reproduce", "backcopy-study", "simplifed"], "simplifed"),
    ],
)
def test_cli_mistakes_are_one_line(argv, needle, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sharpattn: error:") and needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="--steps applies to the simplified study only"):
        bs.run_study(tmp_path / "y", "sgd", steps=10)
    assert "simplified" in bs.NAMES


def test_cli_runs_the_study(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bsm, "PAPER", tiny())  # the command's settings, tiny
    argv = ["reproduce", "backcopy-study", "simplified", "--steps", "5", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "App. C.3" in out and "seed0" in out
    assert json.loads((tmp_path / "results.json").read_text())["runs"]["seed0"]["steps"] == 5
