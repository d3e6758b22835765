"""How long a screened batch waits on its engines: pilots dispatched ahead against one pilot per open slot.

    .venv/bin/python benchmarks/bench_screening.py [--latency 0.2] [--batches 6] [--out benchmarks/results]

The real ``D3SSamplesGenerator`` (its screened loop, upstream's dispatch and ``ray.wait``) draws batches of B = 16
prompts x G = 16 rollouts with pilots of k = 4, from a fake vLLM engine: a Ray actor whose every request takes
``--latency`` seconds whatever its size, as a batching engine serves short requests. A prompt's pilot passes with
probability ``acceptance`` (decided by its index, the same in both arms). The time of a batch, in units of that
latency, counts the rounds of requests it waited for: at least 2 (a pilot, then the rest of its group). The arms:

- ``ahead`` (ours, ``core.screening.pilots_to_dispatch``): pilots in flight topped up to ceil(needed / acceptance
  estimate) whenever a request returns, the estimate counting the batch's pilots so far;
- ``one per slot``: the estimate pinned at 1, so a screened pilot's slot is refilled by one new pilot only when it
  returns (a serial tail).

Writes ``screening.json`` to ``--out``; report.py makes RESULTS.md's section of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import ray
from torchdata.stateful_dataloader import StatefulDataLoader

from bench_selection import cpu_model
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.screening import AcceptanceEstimate
from d3s_openrlhf.integration.host import config_namespace, parse_host_args
from d3s_openrlhf.integration.samples_generator import D3SSamplesGenerator

B, G, K = 16, 16, 4
PROMPTS = 4096
ACCEPTANCE = (0.2, 0.5, 0.8)


@ray.remote
class FakeEngine:
    """Serves every request after ``latency`` seconds, concurrently (a batching engine on short requests)."""

    def __init__(self, latency):
        self.latency = latency

    async def generate(self, prompt, label, n, accept):
        await asyncio.sleep(self.latency)
        rewards = [float(i % 2) if accept else 1.0 for i in range(n)]
        return [
            dict(
                prompt=prompt,
                label=label,
                observation_tokens=[1, 2, 3, 4],
                action_ranges=[(2, 4)],
                reward=r,
                scores=r,
                rollout_log_probs=None,
                extra_logs={},
            )
            for r in rewards
        ]


def collate(items):
    return tuple(list(column) for column in zip(*items))


class PinnedEstimate(AcceptanceEstimate):
    """The 'one per slot' arm: an acceptance estimate that stays 1."""

    def with_batch(self, accepted, pilots):
        return 1.0


def generator(engine, acceptance, ahead):
    args = parse_host_args(["--rollout.batch_size", str(B), "--rollout.n_samples_per_prompt", str(G)])
    config = D3SConfig.from_flags({"preset": "grpo", "pilot_rollouts": K, "schedule_steps": 10**6})
    args.d3s = config_namespace(config)
    strategy = type("Strategy", (), {"args": args})()
    rows = [("src", f"p{i}", "l", None) for i in range(PROMPTS)]
    loader = StatefulDataLoader(rows, batch_size=1, shuffle=False, collate_fn=collate)

    class Generator(D3SSamplesGenerator):
        def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
            n = generate_kwargs["n_samples_per_prompt"]
            # a prompt's pilot passes with probability `acceptance`, by its index (golden-ratio sequence)
            accepts = [(int(prompt[1:]) * 0.6180339887) % 1.0 < acceptance for prompt in prompts]
            return [engine.generate.remote(p, lab, n, a) for p, lab, a in zip(prompts, labels, accepts)]

    made = Generator(strategy, loader, None, tokenizer=None, vllm_engines=[])
    if not ahead:
        made.acceptance = PinnedEstimate()
    return made


def measure(latency, batches):
    engine = FakeEngine.remote(latency)
    ray.get(engine.generate.remote("warm", "l", 1, True))
    rows = []
    for acceptance in ACCEPTANCE:
        for ahead in (True, False):
            made = generator(engine, acceptance, ahead)
            times, pilots = [], 0.0
            for _ in range(batches):
                start = time.perf_counter()
                samples, *_ = made.generate_samples(max_len=64)
                times.append(time.perf_counter() - start)
                assert len(samples) == B * G
                pilots += made.last_metrics["d3s/pilots"]
            later = times[1:]  # the first batch starts without an estimate in both arms
            rows.append(
                dict(
                    acceptance=acceptance,
                    arm="ahead" if ahead else "one per slot",
                    rounds_first=times[0] / latency,
                    rounds_later=sum(later) / len(later) / latency,
                    pilots_per_batch=pilots / batches,
                )
            )
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per request of the fake engine")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    options = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = measure(options.latency, options.batches)
    finally:
        ray.shutdown()
    command = f".venv/bin/python benchmarks/bench_screening.py --latency {options.latency} --batches {options.batches}"
    document = dict(
        command=command,
        machine=cpu_model(),
        date=time.strftime("%Y-%m-%d"),
        batch=B,
        group=G,
        pilot=K,
        latency=options.latency,
        rows=rows,
    )
    path = Path(options.out) / "screening.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
