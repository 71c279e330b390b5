"""Prompt data: verl-schema parquet datasets, resumable sampling, preprocessing, a local tokenizer."""
from .dataset import DataError, PromptDataset, PromptItem, read_rows, tokenize_prompt
from .sampler import PromptSampler
from .tiny import build_word_tokenizer

__all__ = ["DataError", "PromptDataset", "PromptItem", "read_rows", "tokenize_prompt", "PromptSampler",
           "build_word_tokenizer"]
