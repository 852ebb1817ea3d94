"""Issue 15 items 5-8 on Bigram-Backcopy: the studies, Prop. B.0, sink-logit concentration,
interventions on layer 0, SGD momentum and the medium profile."""

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn.cli import main
from sharpattn.experiments import backcopy as bb
from sharpattn.experiments.backcopy import studies as bs
from sharpattn.experiments.backcopy.theory import prop_b0_gradient, prop_b0_simulation
from sharpattn.models.transformer import Transformer
from sharpattn.tasks.bigram_backcopy import BigramBackcopy

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def task():
    return BigramBackcopy.tiny_shakespeare()


def np_prop_b0(optimizer, steps, lr=0.3, m0=1.0, b1=0.9, b2=0.999, wd=1e-8, eps=1e-8):
    """Adam with decoupled weight decay (Loshchilov & Hutter) and SGD written out in float64."""
    m, mom, var = m0, 0.0, 0.0
    out = [m0]
    for t in range(1, steps + 1):
        g = -np.log(t) / (np.sqrt(t) * m**3)
        if optimizer == "sgd":
            m = m - lr * g
        else:
            m = m * (1 - lr * wd)
            mom = b1 * mom + (1 - b1) * g
            var = b2 * var + (1 - b2) * g * g
            m = m - lr * (mom / (1 - b1**t)) / (np.sqrt(var / (1 - b2**t)) + eps)
        out.append(m)
    return np.array(out)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_prop_b0_simulation_matches_numpy(optimizer):
    # float64, 300 steps of a handful of operations each: rounding grows to ~300·10·eps·|m|
    # (|m| ≤ 100), far below 1e-9 relative
    got = prop_b0_simulation(optimizer, 300)
    want = np_prop_b0(optimizer, 300)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=0)
    assert prop_b0_gradient(2.0, 1) == 0.0  # log 1 = 0
    assert_close(prop_b0_gradient(2.0, 4), -np.log(4) / (2 * 8), dtype=torch.float64, n=3)


def test_prop_b0_adam_outgrows_sgd():
    # the claim of Fig. 15, at 2,000 steps: SGD moves m by lr·log t/(√t m³) (m⁴ ~ √t log t),
    # Adam by about lr·g/√(mean g²), which keeps m growing: 13.5 vs 5.0 here
    adam, sgd = prop_b0_simulation("adam", 2000), prop_b0_simulation("sgd", 2000)
    assert adam[-1] > 2 * sgd[-1] and np.all(np.diff(adam[1:]) > 0)
    f, curves = bb.finding_7(steps=2000, fit_from=200)
    assert f.number == 7 and f.verdict in ("reproduced", "partly reproduced")
    np.testing.assert_array_equal(curves["adam"], adam)
    with pytest.raises(ValueError, match="optimizer"):
        prop_b0_simulation("lion", 10)


def test_zeroing_layer_0_leaves_the_embeddings_as_its_output(task):
    torch.manual_seed(0)
    cfg = bb.RunConfig(layers="attn+mlp+attn+mlp+mlp", d_model=16, seq_len=12, n_measure=2)
    m = Transformer(cfg.model_config(task))
    x = task.sample(3, 12, seed=1)
    zero = ("layers.0.attn", "layers.0.mlp")
    got = bb.measure(m, task, x, zero)
    assert "layers.0.attn.delta_logit" not in got and "layers.1.attn.delta_logit" in got
    h = (m.tok_emb.weight[x] + m.pos_emb.weight[:12]).detach().double().norm(dim=-1)  # (B, T)
    # float32 embeddings of 16 entries: norm relative error ≲ 16·eps32
    assert_close(got["layers.0.res_bos"], float(h[:, 0].mean()), dtype=torch.float32, n=16)
    assert_close(got["layers.0.res_other"], float(h[:, 1:].mean()), dtype=torch.float32, n=16)
    full = bb.measure(m, task, x)
    assert full["layers.0.res_bos"] != got["layers.0.res_bos"]


def test_sgd_momentum(task):
    cfg = bb.RunConfig(optimizer="sgd", momentum=0.9, d_model=16, seq_len=8)
    opt = bb.make_optimizer(cfg, bb.build_model(cfg, task))
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["lr"] == 0.03
    plain = bb.make_optimizer(bb.RunConfig(optimizer="sgd", d_model=16), torch.nn.Linear(2, 2))
    assert plain.param_groups[0]["momentum"] == 0
    with pytest.raises(ValueError, match="momentum applies to SGD only"):
        bb.RunConfig(momentum=0.9)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        bb.RunConfig(optimizer="sgd", momentum=1.0)
    # an old run's config (no momentum key) keeps its identity: the default is None
    assert bb.RunConfig(optimizer="sgd").to_dict()["momentum"] is None


def test_medium_profile_and_flags(capsys):
    c = bb.profile_config("medium", "3L-softmax-adam")
    assert (c.d_model, c.seq_len, c.batch, c.steps, c.learning_rate) == (128, 128, 32, 10_000, 3e-4)
    assert bb.profile_config("medium", "3L-softmax-sgd").learning_rate == 0.03
    assert main(["reproduce", "backcopy", "--quick", "--medium"]) == 2
    err = capsys.readouterr().err
    assert "--quick and --medium exclude each other" in err and len(err.strip().splitlines()) == 1
    assert main(["reproduce", "backcopy", "--help"]) == 0
    assert "--medium" in capsys.readouterr().out
    assert main(["reproduce", "max-retrieval", "--medium"]) == 2  # only backcopy has it
    assert "--medium" in capsys.readouterr().err


def test_study_configs_change_one_factor():
    cfgs = bs.study_configs("relu-peak")
    base = cfgs["relu-lr3e-3-s0"].to_dict()
    for name, c in cfgs.items():
        diff = {k for k, v in c.to_dict().items() if v != base[k]}
        changed = {"method", "lr", "steps", "weight_decay", "layers", "batch", "loss_from", "seed"}
        assert diff <= changed, name
    assert {c.seed for c in cfgs.values()} == {0, 1}
    assert set(bs.study_configs("sgd", seeds=2)) >= {"sgd-0.3-s0", "sgd-0.3-s1"}
    with pytest.raises(ValueError, match="study must be one of"):
        bs.study_configs("nope")


def test_run_study_writes_its_report(task, tmp_path, monkeypatch):
    tiny = dict(
        d_model=16,
        seq_len=12,
        batch=4,
        steps=6,
        eval_batch=4,
        n_measure=3,
        checkpoint_every=3,
        lr=3e-3,
        layers="attn+mlp+attn+mlp+mlp",
    )
    study = bs.Study("tiny", tiny, {"a": {}, "b": {"method": "relu"}}, seeds=(0,))
    monkeypatch.setitem(bs.STUDIES, "fig7b", study)
    path, res = bs.run_study(tmp_path / "s", "fig7b", task=task)
    text = (path / "report.md").read_text()
    assert "a-s0" in text and "b-s0" in text and "layer 0 zeroed" in text
    assert (path / "residual.png").is_file()
    run = bb.train(tmp_path / "s" / "runs" / "a-s0", bb.RunConfig(**tiny, seed=0), task)
    assert res["runs"]["a-s0"]["res_bos"] == run.metrics[-1]["layers.0.res_bos"]
    assert [r["zeroed"] for r in res["fig7b"]] == ["none", "layer 0"] * 2


def test_loss_from_drops_the_first_positions(task):
    torch.manual_seed(0)
    cfg = bb.RunConfig(d_model=16, seq_len=10, loss_from=1)
    m = bb.build_model(cfg, task)
    x = task.sample(3, 11, seed=2)
    with torch.no_grad():
        logits = m(x[:, :-1]).double().numpy()  # (B, T, V)
    # independent: log-softmax in float64, mean over positions 1..T-1 of −log q(next)
    z = logits - logits.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nxt = x[:, 1:].numpy()
    ce = -np.take_along_axis(logq, nxt[..., None], -1)[..., 0]  # (B, T)
    # float32 logits of a 64-way softmax, mean of 27 terms: ~64·eps32 relative
    with torch.no_grad():
        got1 = float(bb.next_token_loss(m, x, 1))
        got0 = float(bb.next_token_loss(m, x))
    assert_close(got1, ce[:, 1:].mean(), dtype=torch.float32, n=64)
    assert_close(got0, ce.mean(), dtype=torch.float32, n=64)
    assert abs(got1 - got0) > 1e-4
    with pytest.raises(ValueError, match="loss_from"):
        bb.RunConfig(seq_len=10, loss_from=10)


def test_key_class_weights_by_hand(task):
    # T = 3 without BOS: tokens [a, ' ', '.'] → first, trigger (space is id 0), delimiter
    ids = {c: i for i, c in enumerate(task.chars)}
    tokens = torch.tensor([[ids["a"], ids[" "], ids["."]]])
    w = torch.tensor([[[1.0, 0, 0], [0.6, 0.4, 0], [0.5, 0.3, 0.2]]])
    q = torch.tensor([[True, False, True]])  # queries 0 and 2
    got = bb.key_class_weights(w, tokens, q, task)
    # pairs: (0,0) 1.0 first; (2,0) 0.5 first; (2,1) 0.3 trigger; (2,2) 0.2 delimiter
    # (float32 weights: means of ≤ 4 of them, within a few float32 ulps)
    assert_close(got["first"], 0.75, dtype=torch.float32, n=2)
    assert_close(got["trigger"], 0.3, dtype=torch.float32)
    assert_close(got["delimiter"], 0.2, dtype=torch.float32)
    assert np.isnan(got["other"])
    assert_close(got["uniform"], (1 + 3 * (1 / 3)) / 4, dtype=torch.float64, n=4)


def test_a_run_without_bos(task, tmp_path):
    cfg = bb.RunConfig(
        d_model=16,
        seq_len=12,
        batch=4,
        steps=4,
        eval_batch=4,
        n_measure=2,
        checkpoint_every=2,
        lr=3e-3,
        bos=False,
    )
    run = bb.train(tmp_path / "r", cfg, task)
    last = run.metrics[-1]
    assert "layers.0.attn.weight_first" in last and "layers.0.res_bos" not in last
    # the risks are those of the model reading the evaluation sequences without their BOS
    ev = bb.eval_tokens(cfg, task)
    with torch.no_grad():
        want = task.risks(run.model.eval()(ev[:, 1:]), ev, drop=1)
    assert last["bigram_excess"] == want["bigram_excess"]
    # the training batches hold no BOS: the model never reads one
    seen = []
    t = bb.trainer(tmp_path / "s", cfg, task)
    orig = t.batch
    t.batch = lambda step: seen.append(orig(step)) or seen[-1]
    t.run()
    assert seen and all(bool((b != task.bos).all()) and b.shape[1] == 13 for b in seen)


@pytest.mark.cpu_independent
def test_chosen_variants_in_a_process_pool_give_the_sequential_numbers(task, tmp_path, monkeypatch):
    tiny = dict(
        d_model=16,
        seq_len=12,
        batch=4,
        steps=6,
        eval_batch=4,
        n_measure=3,
        checkpoint_every=3,
        lr=3e-3,
    )
    study = bs.Study(
        "tiny", tiny, {"a": {}, "b": {"method": "relu"}, "c": {"lr": 1e-3}}, seeds=(0,)
    )
    monkeypatch.setitem(bs.STUDIES, "relu-peak", study)
    _, pooled = bs.run_study(tmp_path / "p", "relu-peak", task=task, variants=("a", "c"), workers=2)
    assert set(pooled["runs"]) == {"a-s0", "c-s0"}
    _, alone = bs.run_study(tmp_path / "s", "relu-peak", task=task, variants=("a", "c"))
    for name in ("a-s0", "c-s0"):
        for key in ("res_bos", "bigram_excess", "backcopy_excess"):
            assert pooled["runs"][name][key] == alone["runs"][name][key]
    with pytest.raises(ValueError, match="has no variant 'd'"):
        bs.study_configs("relu-peak", variants=("d",))
