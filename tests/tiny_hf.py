"""Tiny randomly initialised Hugging Face models (no downloads), shared by the HF tests."""

import transformers


def llama(**overrides):
    cfg = transformers.LlamaConfig(
        **{
            "vocab_size": 97,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            **overrides,
        }
    )
    return transformers.LlamaForCausalLM(cfg)


def mistral(sliding_window=4, **overrides):
    """A tiny Mistral: Llama's shapes with a sliding window of ``sliding_window`` keys."""
    cfg = transformers.MistralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=sliding_window,
        **overrides,
    )
    return transformers.MistralForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def neox():
    cfg = transformers.GPTNeoXConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    return transformers.BertModel(cfg)


class CharTokenizer:
    """A tokenizer for the tiny models: one id per character (3 … 96), no special tokens (so
    ``add_special_tokens`` changes nothing)."""

    eos_token_id = 0

    def __call__(self, text, return_tensors="pt", add_special_tokens=True):
        import torch

        ids = torch.tensor([3 + ord(c) % 94 for c in text], dtype=torch.long)
        return {"input_ids": ids[None]}


def pretrained(name="tiny", **_):
    """``(model, tokenizer)`` as ``load_pretrained`` returns them: a tiny Llama with fixed weights
    (built from its own seed, leaving the global generator as it was) and :class:`CharTokenizer`."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = llama().eval()
    return net, CharTokenizer()


def stand_in_for_pretrained():
    """Make ``sharpattn.integrations.pretrained.load_pretrained`` return :func:`pretrained`, so the
    pretrained-model commands run on a tiny model (in this process)."""
    from sharpattn.integrations import pretrained as module

    module.load_pretrained = pretrained
