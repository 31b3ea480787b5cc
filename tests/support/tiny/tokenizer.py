"""The tiny models' tokenizer: a small byte-level BPE (vocab 384) trained on a fixed corpus, with
its special ids (end of text, the draft's mask) and a chat template; every tiny target carries it."""

from __future__ import annotations

import os

EOS_ID, MASK_ID = 0, 1
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def make_tokenizer(path: str, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # A fixed corpus that exists on every machine: the json package's sources.
    corpus_dir = os.path.join(os.path.dirname(os.__file__), "json")
    files = sorted(os.path.join(corpus_dir, f) for f in os.listdir(corpus_dir) if f.endswith(".py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|MASK|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|MASK|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
