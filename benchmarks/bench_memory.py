"""Peak memory of the experience-making log-prob/entropy forward: upstream's full logits vs the chunked kernel.

For one sequence of T tokens, hidden size H and vocabulary V (defaults: qwen2.5-0.5b's H = 896, the Qwen2.5
vocabulary V = 151,936), starting from the final hidden states (the model body is identical in every variant):

* upstream:      OpenRLHF's Actor.forward tail: logits = lm_head(hidden).float() (/ temperature),
                 ``log_probs_from_logits`` and ``compute_entropy`` over all of them;
* upstream+tap:  the same plus D3S's entropy tap on the action slice logits[:, :-1][:, -A:] (A = T/2) through
                 ``entropy_from_logits``: its extra peak over upstream is what the entropy costs;
* chunked:       ``chunked_logprobs_entropy`` from the hidden states (default chunk size), no full logits.

Peak = the maximum, over the call, of the bytes held by torch's CPU allocator above the level at its start, from
the ``[memory]`` events of torch.profiler(profile_memory=True) (exact, no CUDA needed; ``memory_probe.py``, the
probe of the tests' ``peak_memory`` fixture too). fp32 weights (the CPU's fast path); on GPU the lm_head runs in
bf16 and the logits are cast to fp32, so upstream's peak there is 1.5x the fp32 logits.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py            # writes benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from openrlhf.models.utils import compute_entropy, log_probs_from_logits

from d3s_openrlhf.core.entropy import entropy_from_logits
from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy, default_chunk_size
from memory_probe import MIB, peak_allocated_bytes  # benchmarks/ is sys.path[0] when this file runs


def upstream(hidden, weight, targets, action_width, tap):
    logits = F.linear(hidden, weight).to(torch.float32)
    entropy = compute_entropy(logits)[:, :-1]
    log_probs = log_probs_from_logits(logits, targets)[:, :-1][:, -action_width:]
    if tap:
        entropy = entropy_from_logits(logits[:, :-1][:, -action_width:])
    return log_probs, entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "memory.json")
    args = parser.parse_args()

    rows = []
    weight = torch.randn(args.vocab, args.hidden) / args.hidden**0.5
    for tokens in args.tokens:
        hidden = torch.randn(1, tokens, args.hidden)
        targets = torch.randint(0, args.vocab, (1, tokens))
        width = tokens // 2
        row = {"tokens": tokens, "logits_fp32_mib": tokens * args.vocab * 4 / MIB}
        row["upstream_mib"] = peak_allocated_bytes(lambda: upstream(hidden, weight, targets, width, False))[1] / MIB
        row["upstream_tap_mib"] = peak_allocated_bytes(lambda: upstream(hidden, weight, targets, width, True))[1] / MIB
        chunked = peak_allocated_bytes(lambda: chunked_logprobs_entropy(hidden, weight, targets, with_entropy=True))
        row["chunked_mib"] = chunked[1] / MIB
        rows.append(row)
        print(
            " ".join(
                f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items()
            )
        )

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {
        "date": now,
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
        "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk_size": default_chunk_size(args.vocab),
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
