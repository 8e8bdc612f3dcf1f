"""A tiny Llama model directory made on the spot, for real vLLM with ``--load-format dummy``.

No weights are downloaded or stored: vLLM fills the parameters with random values, so
the model answers fast and says nonsense. What matters for the router is real: the
engine's tokenizer (a byte-level BPE trained here), its chat template, its scheduler,
prefix cache, KV events and KV transfer.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).parent.parent / "fixtures" / "tokenizer" / "tokenizer_config.json"

VOCAB_SIZE = 384
SPECIAL = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "the router sends each request where its prefix is cached",
    "prefill is compute bound and decode is memory bound",
    "a block holds thirty two tokens of the prompt on the cpu build",
    "you are a helpful assistant answer briefly and plainly",
    "system user assistant question answer context document shared prefix",
    "0 1 2 3 4 5 6 7 8 9 alpha beta gamma delta epsilon zeta eta theta",
] * 30

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": VOCAB_SIZE,
}


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path))


def make_tiny_llama(directory: Path) -> Path:
    """Write config.json, tokenizer.json, tokenizer_config.json and generation_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2})
    )
    _train_tokenizer(directory / "tokenizer.json")
    tokenizer_config = json.loads(FIXTURE.read_text())
    tokenizer_config["model_max_length"] = CONFIG["max_position_embeddings"]
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


if __name__ == "__main__":
    # `python tests/support/tiny_model.py DIR`: a model directory for kvroute bench's
    # --engine-cmd against real vLLM (docs/benchmarks.md).
    import sys

    print(make_tiny_llama(Path(sys.argv[1])))
