"""A tokenizer and a dataset made in-process, so trainers run on CPU with nothing downloaded."""
from __future__ import annotations

import random


def make_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def make_texts(n: int = 16, vocab_size: int = 128, seed: int = 0):
    rnd = random.Random(seed)
    return [" ".join(f"w{rnd.randrange(vocab_size - 4)}" for _ in range(rnd.randrange(5, 14))) for _ in range(n)]
