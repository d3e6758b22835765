"""The testbed's model, built locally (no hub), over a task's characters (the addition task's by default).

- tokenizer: character level (``tokenizers`` WordLevel over single characters) and four special tokens; spaces
  are normalised away (OpenRLHF's SFT dataset puts one before the EOS token);
- model: a 2-layer Llama with head_dim 32 (vLLM's CPU attention needs head_dim in {32, 64, 80, ...}) and tied
  input/output embeddings, saved with ``save_pretrained`` (bfloat16, what OpenRLHF trains and vLLM serves);
- :func:`write_jsonl` writes OpenRLHF's JSONL datasets.
"""

import json
from dataclasses import dataclass

from d3s_openrlhf.tasks.addition import CHARACTERS

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def build_tokenizer(filler_tokens=0, characters=CHARACTERS):
    """The character-level tokenizer over ``characters`` (one token each); ``filler_tokens`` adds that many
    vocabulary entries ``<f0>``, ``<f1>``, ... that no text encodes to (a randomly initialised model then rarely
    samples EOS: long responses for timing)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fillers = tuple(f"<f{i}>" for i in range(filler_tokens))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(characters) + fillers)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Replace(Regex(r"\s+"), "")
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 512
    max_positions: int = 64


def build_model(tokenizer, shape=ModelShape(), seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def save_model_and_tokenizer(path, shape=ModelShape(), seed=0, filler_tokens=0, characters=CHARACTERS):
    """Write a fresh (randomly initialised) model and its tokenizer to ``path``; returns ``path``."""
    tokenizer = build_tokenizer(filler_tokens, characters)
    model = build_model(tokenizer, shape, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
