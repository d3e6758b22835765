"""Time and peak memory of the actor's log-prob forwards at the LM head, upstream's way against ours, wherever CUDA
is (torch, transformers and openrlhf; no Ray, vLLM or DeepSpeed process).

A Qwen2.5-like model (vocabulary 151,936, hidden 3,584 as Qwen2.5-7B, untied head; ``--layers`` of body, 2 by
default: the body is the same in every variant, so more layers add the same time and memory to each) in bf16,
one sequence of T tokens whose last 3/4 are the response (A action tokens). Per T:

Experience-making forward (no grad):
* ``upstream``: the model's logits (B, S, V), cast to fp32, / temperature in place, then OpenRLHF's own
  ``log_probs_from_logits`` (what ``Actor.forward`` runs);
* ``ours``: the model up to its head, then ``core.logprobs.chunked_logprobs_entropy`` at the action positions (the
  log-probs and the entropy the token scores need).

Training step (forward and backward of the PPO-clip loss over the kept tokens, plus a k3 KL loss over every action
token with ``kl on``):
* ``upstream``: upstream's forward on the path its ``log_probs_from_logits`` takes on this device: flash-attn's
  Triton cross-entropy where it imports on CUDA (every GPU install of OpenRLHF), else its torch fallback. The
  output's ``upstream_path`` says which ran; where it was the Triton kernel, ``upstream, torch fallback`` is
  measured too (upstream without flash-attn);
* ``ours K``: the head at the kept tokens only (K < 1, kl off) or at every action token (kl on, or K = 1: what
  ``--d3s.chunked_logits`` runs), through the chunked kernel.

The whole actor step through OpenRLHF's ``Actor`` (batches of responses, real body layers): ``bench_actor_gpu.py``.

Peak = ``torch.cuda.max_memory_allocated`` above the level at the call (gradient buffers exist before, as in
training); time = median of ``--repeats`` synchronised calls after one warm-up. On a CPU (``--device cpu``, for a
smoke run) the peak comes from torch's allocator events (``memory_probe``).

    PYTHONPATH=$PWD python benchmarks/bench_forward_gpu.py       # writes benchmarks/results/forward_gpu.json
    .venv/bin/python benchmarks/report.py                         # its table in RESULTS.md (section 5)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

import torch
from openrlhf.models.utils import log_probs_from_logits
from transformers import Qwen2Config, Qwen2ForCausalLM

from d3s_openrlhf.core.logprobs import chunk_budget_bytes, chunked_logprobs_entropy, default_chunk_size
from memory_probe import MIB, peak_allocated_bytes  # benchmarks/ is sys.path[0] when this file runs
from upstream_logprobs import torch_fallback, upstream_path

TEMPERATURE = 0.6  # the scripts' --rollout.temperature: upstream divides its fp32 logits in place


def make_model(args):
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 7),
        max_position_embeddings=max(args.tokens),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device=args.device, dtype=args.dtype)


def batch(tokens: int, width: int, vocab: int, device):
    g = torch.Generator().manual_seed(tokens)
    sequences = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    advantages = torch.randn(1, width, generator=g).to(device)
    scores = advantages.abs() * torch.rand(1, width, generator=g).to(device)
    return sequences, advantages, scores


def upstream_action_log_probs(model, sequences, width, fallback=False):
    """``Actor.forward``'s arithmetic from the model's output: (1, S, V) logits to fp32, / temperature in place, its
    ``log_probs_from_logits`` (with ``fallback``: its torch path), the (1, A) action positions."""
    logits = model(sequences).logits.to(torch.float32).div_(TEMPERATURE)
    labels = torch.roll(sequences, -1, dims=1)
    with torch_fallback() if fallback else contextlib.nullcontext():
        log_probs = log_probs_from_logits(logits, labels)
    return log_probs[:, :-1][:, -width:]


def ours_action_log_probs(model, sequences, width, rows, with_entropy):
    """(log_probs, entropy) at the (1, A) action positions ``rows`` (a bool mask), from the hidden states; the
    entropy None without ``with_entropy`` (the training forward without an entropy bonus)."""
    hidden = model.model(sequences).last_hidden_state[:, -1 - width : -1]  # positions that predict the actions
    targets = sequences[:, -width:]
    log_probs, entropy = chunked_logprobs_entropy(
        hidden[rows], model.lm_head.weight, targets[rows], temperature=TEMPERATURE, with_entropy=with_entropy
    )
    return log_probs, entropy


def training_loss(log_probs, old, advantages, kept, kl_ref):
    """PPO-clip over the kept tokens (token mean) + 0.01 * k3 KL over every action token (when ``kl_ref``)."""
    ratio = torch.exp(log_probs - old)
    surrogate = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    loss = (surrogate * kept).sum() / kept.sum().clamp(min=1)
    if kl_ref is not None:
        log_ratio = kl_ref - log_probs
        loss = loss + 0.01 * (log_ratio.exp() - 1 - log_ratio).mean()
    return loss


def measure(fn, device, repeats):
    fn()  # warm-up: lazy initialisation and the gradient buffers are not part of the step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = peak_allocated_bytes(fn)[1]
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"peak_mib": peak / MIB, "seconds": statistics.median(seconds)}


def upstream_variants(device) -> dict:
    """Upstream's paths to measure on ``device``, by name: whichever ``log_probs_from_logits`` takes there, and its
    torch fallback beside the Triton kernel (upstream without flash-attn)."""
    fallback = not upstream_path(device).startswith("flash-attn")
    return {"upstream": fallback} | ({} if fallback else {"upstream, torch fallback": True})


def run_length(model, tokens, args):
    width = int(tokens * args.action_share)
    sequences, advantages, scores = batch(tokens, width, args.vocab, args.device)
    every = torch.ones(1, width, dtype=torch.bool, device=args.device)
    variants = upstream_variants(args.device)
    with torch.no_grad():
        old = upstream_action_log_probs(model, sequences, width, variants["upstream"]) - 0.05
    reference = old - 0.05
    row = {"tokens": tokens, "action_tokens": width, "logits_fp32_mib": tokens * args.vocab * 4 / MIB}

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    experience = {
        "upstream": no_grad(lambda: upstream_action_log_probs(model, sequences, width, variants["upstream"])),
        "ours": no_grad(lambda: ours_action_log_probs(model, sequences, width, every, with_entropy=True)),
    }
    row["experience"] = {name: measure(fn, args.device, args.repeats) for name, fn in experience.items()}

    def step(forward, kept, kl):
        def run():
            model.zero_grad(set_to_none=False)
            log_probs = forward()
            training_loss(log_probs, old, advantages, kept, reference if kl else None).backward()

        return run

    row["training"] = {}
    for kl in (False, True):
        cells = row["training"]["kl on" if kl else "kl off"] = {}
        for name, fallback in variants.items():
            upstream = step(lambda f=fallback: upstream_action_log_probs(model, sequences, width, f), every, kl)
            cells[name] = measure(upstream, args.device, args.repeats)
        for fraction in args.fractions:
            keep = max(1, math.ceil(fraction * width))
            kept = torch.zeros_like(every)
            kept[0, scores[0].topk(keep).indices] = True
            rows = every if kl or fraction >= 1 else kept

            def ours(rows=rows):
                log_probs, _ = ours_action_log_probs(model, sequences, width, rows, with_entropy=False)
                return old.masked_scatter(rows, log_probs) if rows is not every else log_probs.view(1, width)

            cells[f"ours {fraction:g}"] = measure(step(ours, kept, kl), args.device, args.repeats)
    return row


def environment(device) -> dict:
    """The date, the machine and the versions of what ran, for the benchmarks' JSON."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    versions = {"torch": torch.__version__}
    for package in ("transformers", "openrlhf", "deepspeed", "flash-attn", "triton"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{name} ({device.type}), torch {torch.__version__}",
        "versions": versions,
    }


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    parser.add_argument("--action-share", type=float, default=0.75)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "forward_gpu.json")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    model = make_model(args)
    budget = chunk_budget_bytes(args.device)
    rows = []
    for tokens in args.tokens:
        rows.append(run_length(model, tokens, args))
        print(f"T = {tokens}: {json.dumps(rows[-1])}", flush=True)
    result = {
        **environment(args.device),
        "model": (
            f"Qwen2-like, vocabulary {args.vocab:,}, hidden {args.hidden}, {args.layers} layers, untied head, "
            f"{str(args.dtype).removeprefix('torch.')}"
        ),
        "upstream_path": upstream_path(args.device),
        "chunk_rows_at_start": default_chunk_size(args.vocab, budget),
        "repeats": args.repeats,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
