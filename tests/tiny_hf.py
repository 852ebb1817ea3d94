"""Tiny randomly initialised Hugging Face models (no downloads), shared by the HF tests."""

import transformers


def llama(**overrides):
    cfg = transformers.LlamaConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        **overrides,
    })  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def neox():
    cfg = transformers.GPTNeoXConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(cfg)
