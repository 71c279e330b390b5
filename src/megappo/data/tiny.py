"""A small word-level tokenizer with a chat template, built locally (no hub access): the
tokenizer of the tiny CPU models and synthetic tasks."""
from __future__ import annotations

__all__ = ["SPECIAL_TOKENS", "build_word_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_word_tokenizer(words):
    """Whitespace/punctuation-split words -> ids; ``</s>`` is EOS and ``<pad>`` (id 0) the pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=SPECIAL_TOKENS[4:])
    fast.chat_template = CHAT_TEMPLATE
    return fast
