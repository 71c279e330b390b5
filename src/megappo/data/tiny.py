"""A small word-level tokenizer with a chat template, built locally (no hub access): the
tokenizer of the tiny CPU models and synthetic tasks."""
from __future__ import annotations

__all__ = ["SPECIAL_TOKENS", "build_word_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_word_tokenizer(words, extra_special=()):
    """Whitespace/punctuation-split words -> ids; ``</s>`` is EOS and ``<pad>`` (id 0) the pad.
    ``extra_special``: more special tokens (matched whole, dropped by ``skip_special_tokens``), after
    the words, so the ids of the other tasks' tokens do not move."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for w in [*words, *extra_special]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>",
                                   additional_special_tokens=SPECIAL_TOKENS[4:] + list(extra_special))
    fast.chat_template = CHAT_TEMPLATE
    return fast


TASKS = ("echo", "words", "pick_first", "copy", "pick_last", "lookup")


def make_tiny_setup(out_dir: str, *, n_train: int = 512, n_test: int = 64, seed: int = 0, arch: str = "qwen3",
                    task: str = "echo") -> dict:
    """Everything the CPU main job needs, built locally: a word tokenizer, a tiny random-init
    model folder (HF config, safetensors, tokenizer) and a synthetic task (``echo``: reward on one
    token; ``words``, ``pick_first``, ``copy``, ``pick_last``: reward spread over the response;
    ``lookup``: a multi-turn task only the ``lookup`` tool can solve; see megappo.rewards.synthetic;
    all but echo and words use a smaller model: vocabulary 64, 2 layers).
    Returns the paths {"model", "train", "test"}. Idempotent: existing files are kept."""
    import os

    import torch

    from megappo.data.preprocess import ECHO_WORDS, write_parquet
    from megappo.rewards import synthetic

    model_dir = os.path.join(out_dir, "model")
    data_dir = os.path.join(out_dir, "data")
    paths = {"model": model_dir, "train": os.path.join(data_dir, "train.parquet"),
             "test": os.path.join(data_dir, "test.parquet")}
    if arch not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"make_tiny_setup: unknown arch {arch!r}; expected qwen3 or qwen3_moe")
    if task not in TASKS:
        raise ValueError(f"make_tiny_setup: unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if not os.path.isfile(paths["train"]):
        if task == "echo":
            make = lambda n, s: synthetic.make_echo_rows(n, ECHO_WORDS, seed=s)  # noqa: E731
        elif task == "words":
            make = lambda n, s: synthetic.make_words_rows(n, seed=s)  # noqa: E731
        elif task == "lookup":
            make = lambda n, s: synthetic.make_lookup_rows(n, seed=s)  # noqa: E731
        else:
            source = {"pick_first": synthetic.PICK_FIRST_SOURCE, "copy": synthetic.COPY_SOURCE,
                      "pick_last": synthetic.PICK_LAST_SOURCE}[task]
            make = lambda n, s: synthetic.make_token_rows(n, seed=s, source=source)  # noqa: E731
        write_parquet(make(n_train, seed), paths["train"])
        write_parquet(make(n_test, seed + 1), paths["test"])
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        from transformers import AutoModelForCausalLM, Qwen3Config

        words = {"echo": ["echo", ":"] + list(ECHO_WORDS), "words": synthetic.WORDS_VOCAB}.get(task, synthetic.TOKEN_WORDS)
        if task == "lookup":
            words = synthetic.LOOKUP_WORDS
        # lookup: the tool role's header and the model's whole tool call are one token each
        tok = build_word_tokenizer(words, synthetic.LOOKUP_SPECIAL if task == "lookup" else ())
        small = task in ("pick_first", "copy", "pick_last", "lookup")
        # lookup: a call ends the model's turn, as a chat model ends its turn after a call
        eos = [tok.eos_token_id, tok.convert_tokens_to_ids(synthetic.LOOKUP_CALL)] if task == "lookup" else tok.eos_token_id
        shape = dict(vocab_size=64 if small else 128, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2 if small else 4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                     eos_token_id=eos)
        # no pad_token_id in the model's config, as in Qwen's released configs (the tokenizer has
        # the pad): transformers would otherwise build Embedding(padding_idx=pad), whose init zeroes
        # that row and whose backward never updates it -- a model TRL and HF train differently
        # from Megatron (which trains every row), and a zero row takes RMSNorm's 1/sqrt(eps) gradient
        if arch == "qwen3_moe":   # Mixture-of-Experts: 4 experts, 2 per token; layer 0 dense
            from transformers import Qwen3MoeConfig

            cfg = Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)
            cfg.architectures = ["Qwen3MoeForCausalLM"]
        else:
            cfg = Qwen3Config(**shape)
            cfg.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(model_dir, safe_serialization=True)
        tok.save_pretrained(model_dir)
    return paths
