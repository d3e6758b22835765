"""A tiny verifiable task and model, built locally (no hub): integer addition ``"12+7="`` -> ``"19"``.

- tokenizer: character level (``tokenizers`` WordLevel over single characters), digits, ``+``, ``=`` and
  four special tokens; spaces are normalised away (OpenRLHF's SFT dataset puts one before the EOS token);
- model: a 2-layer Llama with head_dim 32 (vLLM's CPU attention needs head_dim in {32, 64, 80, ...}) and tied
  input/output embeddings, saved with ``save_pretrained`` (bfloat16, what OpenRLHF trains and vLLM serves);
- data: JSONL files for ``openrlhf.cli.train_sft`` (``input``/``output``) and for ``train_ppo_ray``
  (``input``/``label``), disjoint train and held-out splits;
- reward: :mod:`d3s_openrlhf.cpu.arith_reward`, a ``reward_func`` file for ``--reward.remote_url``.
"""

import json
import os
import random
from dataclasses import dataclass

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = tuple("0123456789+=")


def build_tokenizer(filler_tokens=0, characters=CHARACTERS):
    """The character-level tokenizer over ``characters`` (one token each); ``filler_tokens`` adds that many vocabulary entries ``<f0>``, ``<f1>``, ...
    that no text encodes to (a randomly initialised model then rarely samples EOS: long responses for timing)."""
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


def problems(max_operand, count, seed):
    """``count`` distinct problems ``(a, b)`` with ``0 <= a, b <= max_operand``, in a seeded random order."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if count > len(pairs):
        raise ValueError(f"only {len(pairs)} problems with operands <= {max_operand}")
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def prompt_of(a, b):
    return f"{a}+{b}="


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


@dataclass(frozen=True)
class TaskFiles:
    sft: str
    prompts: str
    heldout: str


def write_task(directory, max_operand=49, n_sft=600, n_prompts=1024, n_heldout=128, seed=0):
    """Disjoint SFT / RL-prompt / held-out splits of the addition task as OpenRLHF JSONL files."""
    os.makedirs(directory, exist_ok=True)
    pairs = problems(max_operand, n_sft + n_prompts + n_heldout, seed)
    sft, rl, heldout = pairs[:n_sft], pairs[n_sft : n_sft + n_prompts], pairs[n_sft + n_prompts :]
    return TaskFiles(
        sft=write_jsonl(
            os.path.join(directory, "sft.jsonl"), [{"input": prompt_of(a, b), "output": str(a + b)} for a, b in sft]
        ),
        prompts=write_jsonl(
            os.path.join(directory, "prompts.jsonl"), [{"input": prompt_of(a, b), "label": str(a + b)} for a, b in rl]
        ),
        heldout=write_jsonl(
            os.path.join(directory, "heldout.jsonl"),
            [{"input": prompt_of(a, b), "label": str(a + b)} for a, b in heldout],
        ),
    )
