"""The LoRA sync on the CPU runtime's real vLLM engine: how much of an update reaches the engine, what a sync costs,
and what the engine's LoRA serving costs in generation; the merged sync against serving the adapter, which was
tried and measured (commit 25a380c) and lost.

    flock /tmp/d3s-heavy.lock .venv/bin/python benchmarks/bench_lora_sync.py            # this tree: merged
    git worktree add /tmp/adapter 25a380c                                                 # the adapter sync's tree
    flock /tmp/d3s-heavy.lock env PYTHONPATH=/tmp/adapter .venv/bin/python benchmarks/bench_lora_sync.py

The measuring code is this tree's (``testbed/sync_check.py``, loaded by path); the sync and the engine are the
package's on ``PYTHONPATH``, and the label (``merged``, ``adapter``) says which sync that package has. Writes
benchmarks/results/lora_sync_<label>.json.

First, on one bf16 linear layer (1024 x 1024, W ~ N(0, 0.02), 256 inputs ~ N(0, 1), a rank-8 update of std 1e-5,
3e-5, 1e-4): the share of the update's exact effect on the layer's output that survives the trainer's unmerged
forward (the adapter's output added to the base output, in bf16) and a forward through the merged bf16 weight.

Then, for each model, all-linear LoRA of rank 16 in bf16, one engine, ZeRO-0 on one rank:
- the share of an update's effect on the trainer's prompt log-probs (its unmerged forward) that reaches the
  engine's, for a fresh adapter whose update has std 1e-5 (RL's early steps) and 1e-4;
- seconds per sync (the trainer's ``broadcast_to_vllm``, which returns once the engine holds the new policy),
  median and min over ``--syncs`` after one warm-up;
- generation throughput after a sync: ``--requests`` requests of ``--tokens`` sampled tokens each (EOS ignored),
  generated tokens per second, median of 3 rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_selection import cpu_model  # benchmarks/ is sys.path[0] when this file runs

HERE = Path(__file__).resolve().parent
RANK = 16
UPDATE_STDS = (1e-5, 1e-4)


def load_sync_check():
    """This tree's ``testbed/sync_check.py`` as a module, whatever package ``d3s_openrlhf`` imports from."""
    spec = importlib.util.spec_from_file_location("sync_check", HERE.parent / "d3s_openrlhf/testbed/sync_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_shares(stds=(1e-5, 3e-5, 1e-4), hidden=1024, rank=8, tokens=256):
    """{std: {"unmerged": share, "merged": share}} of an update's exact effect on one bf16 layer's output."""
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(hidden, hidden, generator=generator) * 0.02).bfloat16()
    inputs = torch.randn(tokens, hidden, generator=generator).bfloat16()
    base = inputs @ weight.T
    shares = {}
    for std in stds:
        a = torch.randn(rank, hidden, generator=generator) / hidden**0.5
        b = torch.randn(hidden, rank, generator=generator)
        b *= std / (b @ a).std()
        exact = inputs.float() @ (b @ a).T
        unmerged = (base + (inputs @ a.bfloat16().T) @ b.bfloat16().T) - base
        merged = inputs @ (weight.float() + b @ a).bfloat16().T - base
        shares[f"{std:g}"] = {
            name: float((change.float() * exact).sum() / (exact * exact).sum())
            for name, change in (("unmerged", unmerged), ("merged", merged))
        }
    return shares


def shapes():
    from d3s_openrlhf.testbed import toy

    return {
        "toy (2 layers, hidden 128)": toy.ModelShape(),
        "8 layers, hidden 512": toy.ModelShape(
            hidden_size=512, num_layers=8, num_heads=8, head_dim=64, intermediate_size=1536, max_positions=128
        ),
    }


def measure(check, engine_swaps, model_dir, options):
    import ray
    from vllm import SamplingParams

    prompts = check.prompt_token_ids(model_dir)
    result = {"effect_share": {}}
    with check.engine_and_trainer(model_dir, RANK, engine_swaps) as (engine, trainer, model):
        for seed, std in enumerate(UPDATE_STDS, 1):
            engine_before = check.logprobs(prompts, lambda ids: check.engine_prompt_logprobs(engine, ids))
            trainer_before = check.logprobs(prompts, lambda ids: check.trainer_prompt_logprobs(model, ids))
            check.set_lora_update(model, seed=seed, std=std)
            target = check.logprobs(prompts, lambda ids: check.trainer_prompt_logprobs(model, ids))
            trainer.broadcast_to_vllm()
            after = check.logprobs(prompts, lambda ids: check.engine_prompt_logprobs(engine, ids))
            result["effect_share"][f"{std:g}"] = check.effect_share(after - engine_before, target - trainer_before)
        seconds = []
        for sync in range(options.syncs + 1):
            check.set_lora_update(model, seed=100 + sync, std=1e-4)
            start = time.perf_counter()
            trainer.broadcast_to_vllm()
            seconds.append(time.perf_counter() - start)
        result["sync_median_s"], result["sync_min_s"] = statistics.median(seconds[1:]), min(seconds[1:])
        params = SamplingParams(max_tokens=options.tokens, ignore_eos=True, temperature=1.0, seed=0)
        rates = []
        for _ in range(4):
            start = time.perf_counter()
            requests = [engine.generate.remote(prompts[i % len(prompts)], params) for i in range(options.requests)]
            outputs = ray.get(requests)
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            rates.append(tokens / (time.perf_counter() - start))
        result["tokens_per_s"] = statistics.median(rates[1:])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    options = parser.parse_args()

    from d3s_openrlhf.testbed import toy

    check = load_sync_check()
    if importlib.util.find_spec("d3s_openrlhf.integration.lora_engine") is not None:  # the adapter sync's tree
        from d3s_openrlhf.integration.swaps import lora_engine_swaps

        label, engine_swaps = "adapter", lambda: lora_engine_swaps(RANK)
    else:  # the merged sync: its engine serves the merged weights
        label, engine_swaps = "merged", tuple
    layer = layer_shares()
    print("one layer", layer, flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, shape in shapes().items():
            model_dir = toy.save_model_and_tokenizer(os.path.join(workdir, str(len(results))), shape, seed=3)
            results[name] = measure(check, engine_swaps, model_dir, options)
            print(label, name, results[name], flush=True)
    document = dict(
        label=label,
        rank=RANK,
        syncs=options.syncs,
        requests=options.requests,
        tokens=options.tokens,
        machine=f"{cpu_model()}, {os.cpu_count()} CPUs",
        date=datetime.date.today().isoformat(),
        layer=layer,
        results=results,
    )
    (HERE / "results" / f"lora_sync_{label}.json").write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
