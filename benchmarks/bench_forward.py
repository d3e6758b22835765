"""Peak memory and time of the actor's forwards with full and with chunked logits, on OpenRLHF's real ``Actor``.

A Qwen2.5-like model (vocabulary 151,936, hidden size 896 as qwen2.5-0.5b, tied embeddings, 2 layers: the body
is the same in every variant, only the LM head's share matters here), one sequence of T tokens of which A = T/2
are action tokens, fp32 on CPU (the CPU's fast path; on GPU the head runs in bf16 and upstream additionally holds
the bf16 logits, so its peak there is about 1.5x these logits).

Experience-making forward (no grad), what a step with K < 1 computes:
* ``upstream``:       OpenRLHF's ``Actor.forward`` (log-probs only: what upstream computes without D3S);
* ``full_logits``:    upstream's forward plus the entropy of its logits (D3S with ``--d3s.full_logits``);
* ``chunked_logits``: ``experience_forward.chunked_logits_log_probs`` (log-probs and entropy, chunked logits).

Training step (forward and backward of a token-mean PG loss over the kept tokens; ``kl``: plus a k3 KL loss over
every action token, as the paper-scale scripts' ``--algo.kl.use_loss``):
* ``upstream torch``:  OpenRLHF's ``Actor.forward`` over every position with its torch log-prob fallback (what runs
                       here: no flash-attn Triton kernel on a CPU);
* ``upstream triton``: the same with the memory profile of flash-attn's Triton cross-entropy, upstream's path on a
                       GPU (``upstream_logprobs.TritonCrossEntropyProfile``);
* ``ours K``:          ``training_forward.training_forward``: log-probs from the hidden states, at the ceil(K * A)
                       kept tokens (``pg``), or at every action token (``kl``; and ``K=1``, what
                       ``--d3s.chunked_logits`` runs at a step without token selection).

and ``floor``: the model up to its head and a zero loss, with every weight's gradient (tied embedding included): what
every variant holds alike, so that peak - floor is the memory of the log-probs (the logits' share).

Peak = the maximum bytes held by torch's CPU allocator above the level at the call's start (torch.profiler
``[memory]`` events, exact, no CUDA needed); time = wall time of a separate, unprofiled call, best of ``--repeats``.
The machine's load average at the start and the end is recorded with the results: on a shared machine other jobs
slow some variants more than others, and the times are then only indicative (the peaks are not affected).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_forward.py      # writes benchmarks/results/forward.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from openrlhf.models import Actor
from openrlhf.models.utils import compute_approx_kl
from transformers import Qwen2Config, Qwen2ForCausalLM

from d3s_openrlhf.core.entropy import entropy_from_logits
from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs
from d3s_openrlhf.integration.training_forward import final_hidden_states, training_forward
from memory_probe import MIB, peak_allocated_bytes  # benchmarks/ is sys.path[0] when this file runs
from upstream_logprobs import install_triton_profile


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def make_actor(args) -> Actor:
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=max(args.tokens),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    actor = Actor(Qwen2ForCausalLM(config).float())
    actor.packing_samples = False  # set by Actor.__init__ only when it loads the model itself
    return actor


def batch(tokens: int, vocab: int):
    width = tokens // 2
    g = torch.Generator().manual_seed(tokens)
    sequences = torch.randint(0, vocab, (1, tokens), generator=g)
    attention_mask = torch.ones(1, tokens, dtype=torch.long)
    action_mask = torch.ones(1, width, dtype=torch.bool)
    advantages = torch.randn(1, width, generator=g)
    return sequences, attention_mask, action_mask, advantages


def experience_variants(actor, sequences, attention_mask, action_mask):
    def upstream():
        with torch.no_grad():
            actor(sequences, action_mask, attention_mask)

    def full_logits():
        with torch.no_grad():
            _, output = actor(sequences, action_mask, attention_mask, return_output=True)
            entropy_from_logits(output["logits"][:, :-1][:, -action_mask.shape[1] :])

    def chunked_logits():
        chunked_logits_log_probs(actor, sequences, action_mask, attention_mask, with_entropy=True)

    return {"upstream": upstream, "full_logits": full_logits, "chunked_logits": chunked_logits}


def training_variants(actor, sequences, attention_mask, action_mask, advantages, fractions):
    with torch.no_grad():
        old = actor(sequences, action_mask, attention_mask)
    reference = old - 0.05
    scores = advantages.abs() * torch.rand(advantages.shape, generator=torch.Generator().manual_seed(1))

    def step(forward, pg_mask, kl):
        def run():
            actor.zero_grad(set_to_none=True)
            log_probs = forward(pg_mask)
            loss = -(torch.exp(log_probs - old) * advantages * pg_mask).sum() / pg_mask.sum().clamp(min=1)
            if kl:
                loss = loss + 0.01 * compute_approx_kl(log_probs, reference, kl_estimator="k3").mean()
            loss.backward()
            actor.zero_grad(set_to_none=True)  # the gradient buffers are the same in every variant

        return run

    def upstream(pg_mask):
        return actor(sequences, action_mask, attention_mask)

    def upstream_triton(pg_mask):
        with install_triton_profile():
            return actor(sequences, action_mask, attention_mask)

    def kept(pg_mask):
        return training_forward(
            actor, sequences, action_mask, attention_mask, log_prob_mask=pg_mask, fill_log_probs=old
        )

    def every(pg_mask):
        return training_forward(actor, sequences, action_mask, attention_mask)

    width = action_mask.shape[1]
    masks = {}
    for fraction in fractions:
        masks[fraction] = torch.zeros_like(action_mask)
        masks[fraction][0, scores[0].topk(max(1, math.ceil(fraction * width))).indices] = True

    def floor():  # what every variant holds alike: the body's activations and every weight's gradient
        actor.zero_grad(set_to_none=True)
        hidden, _ = final_hidden_states(actor, sequences, attention_mask)
        (hidden.sum() * 0 + actor.model.get_output_embeddings().weight.sum() * 0).backward()
        actor.zero_grad(set_to_none=True)

    variants = {"floor, -": floor}
    for kl in (False, True):
        tag = "kl" if kl else "pg"
        variants[f"upstream torch, {tag}"] = step(upstream, action_mask, kl)
        variants[f"upstream triton, {tag}"] = step(upstream_triton, action_mask, kl)
        if kl:  # every action token's log-prob, whatever K: one K shows it
            variants[f"ours K={fractions[-1]:g}, kl"] = step(every, masks[fractions[-1]], kl)
            continue
        for fraction, pg_mask in masks.items():
            variants[f"ours K={fraction:g}, pg"] = step(kept, pg_mask, kl)
        variants["ours K=1, pg"] = step(every, action_mask, kl)
    return variants


def measure(variants, repeats):
    out = {}
    for name, fn in variants.items():
        fn()  # warm-up: lazy initialisation is not part of the step
        out[name] = {"peak_mib": peak_allocated_bytes(fn)[1] / MIB, "seconds": best_seconds(fn, repeats)}
        print(f"  {name:22s} peak {out[name]['peak_mib']:9.1f} MiB   {out[name]['seconds']:7.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "forward.json")
    args = parser.parse_args()

    load_at_start = os.getloadavg()[0]
    actor = make_actor(args)
    rows = []
    for tokens in args.tokens:
        sequences, attention_mask, action_mask, advantages = batch(tokens, args.vocab)
        print(f"T = {tokens}: experience-making forward", flush=True)
        actor.eval()
        experience = measure(experience_variants(actor, sequences, attention_mask, action_mask), args.repeats)
        print(f"T = {tokens}: training step", flush=True)
        actor.train()
        training = measure(
            training_variants(actor, sequences, attention_mask, action_mask, advantages, args.fractions), args.repeats
        )
        logits_mib = tokens * args.vocab * 4 / MIB
        rows.append({"tokens": tokens, "logits_fp32_mib": logits_mib, "experience": experience, "training": training})

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} CPU ({torch.get_num_threads()} torch threads), torch {torch.__version__}",
        "model": f"Qwen2-like, vocabulary {args.vocab:,}, hidden {args.hidden}, {args.layers} layers, tied, fp32",
        "repeats": args.repeats,
        "load_average": [load_at_start, os.getloadavg()[0]],  # 1-minute load at the start and the end
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
