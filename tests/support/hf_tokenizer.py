"""A tiny Hugging Face tokenizer trained on the spot (no downloads) and its chat template."""

from __future__ import annotations

from pathlib import Path

FIXTURE = Path(__file__).parent.parent / "fixtures" / "tokenizer" / "tokenizer_config.json"
SPECIAL = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "the router sends each request where its prefix is cached",
    "prefill is compute bound and decode is memory bound",
    "a block holds sixteen tokens of the prompt",
    "you are a helpful assistant answer briefly",
] * 20


def train_tiny_tokenizer(path: Path) -> Path:
    """A BPE tokenizer with a BOS-adding post-processor, saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path))
    return path
