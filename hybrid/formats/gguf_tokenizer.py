"""Write a Strata byte-level BPE `Tokenizer` into a GGUF file being written.

The fields are those llama.cpp reads for `tokenizer.ggml.model = "gpt2"`, so
files Strata writes load back through `Tokenizer.from_gguf_fields` (and in
llama.cpp) with the same ids.
"""
from __future__ import annotations

import json

import gguf
from gguf import TokenType

from ..errors import ModelError
from ..tokenizer import Tokenizer


def add_tokenizer_to_writer(writer: gguf.GGUFWriter, tokenizer: Tokenizer) -> None:
    """Add tokens, merges, token types, pre-tokenizer, special ids and chat template to `writer`."""
    if tokenizer.pre is None:
        raise ModelError(f"{tokenizer.source}: cannot write the tokenizer to GGUF: its pre-tokenizer "
                         "is not one that tokenizer.ggml.pre can name")
    model = json.loads(tokenizer.backend.to_str())["model"]
    if model.get("type") != "BPE":
        raise ModelError(f"{tokenizer.source}: cannot write a {model.get('type')} tokenizer to GGUF, only BPE")
    tokens, token_types = token_table(tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokens)
    writer.add_token_merges([_merge_text(m, tokenizer.source) for m in model["merges"]])
    writer.add_token_types(token_types)
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    if tokenizer.eos_id is not None:
        writer.add_eos_token_id(tokenizer.eos_id)
    if tokenizer.pad_id is not None:
        writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(tokenizer.add_bos)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def token_table(tokenizer: Tokenizer) -> tuple[list[str], list[int]]:
    """Token text and GGUF token type for every id; ids no token uses become unused `[PAD<id>]`."""
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    num_tokens = max(tokenizer.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(num_tokens)]
    token_types = [int(TokenType.UNUSED)] * num_tokens
    for text, token_id in vocab.items():
        tokens[token_id], token_types[token_id] = text, int(TokenType.NORMAL)
    for token_id, added in backend.get_added_tokens_decoder().items():
        token_types[token_id] = int(TokenType.CONTROL if added.special else TokenType.USER_DEFINED)
    return tokens, token_types


def _merge_text(merge: str | list[str], source: str) -> str:
    pair = merge.split(" ") if isinstance(merge, str) else merge
    if len(pair) != 2 or not all(pair):
        raise ModelError(f"{source}: BPE merge {merge!r} cannot be written as two space-separated tokens")
    return " ".join(pair)
