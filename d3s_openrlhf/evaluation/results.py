"""``DIR/results.json`` and ``DIR/results.md`` from the samples file.

Per model and benchmark (``datasource``): ``prompts`` P, ``n`` N, ``pass@k`` for each k asked (the unbiased
estimator of :mod:`d3s_openrlhf.core.pass_at_k` averaged over the benchmark's prompts, correct = reward >= 1 - 1e-6),
``mean_reward`` (over the sampled responses), ``truncated`` (the fraction that stopped at --max_new_tokens),
``mean_response_tokens``, and with --greedy ``greedy`` (the fraction of prompts whose greedy response is
correct). ``average``: each pass@k (and greedy) as the unweighted mean over benchmarks, as the papers average.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

import numpy as np

from d3s_openrlhf.core.pass_at_k import is_correct, mean_pass_at_k

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def model_block(lines: Sequence[dict], ks: Sequence[int], datasources: Sequence[str]) -> Dict:
    """One model's block from its sample lines; benchmarks in ``datasources`` order (those with lines)."""
    by_source: Dict[str, Dict[int, List[dict]]] = {}
    for line in lines:
        by_source.setdefault(line["datasource"], {}).setdefault(line["index"], []).append(line)
    benchmarks = {}
    for source in datasources:
        prompts = by_source.get(source)
        if not prompts:
            continue
        sampled = [[s for s in group if not s["greedy"]] for group in prompts.values()]
        n = np.array([len(group) for group in sampled])
        c = np.array([int(is_correct([s["reward"] for s in group]).sum()) for group in sampled])
        flat = [s for group in sampled for s in group]
        block = {"prompts": len(sampled), "n": int(n.max())}
        block.update({f"pass@{k}": mean_pass_at_k(n, c, k) for k in ks})
        block["mean_reward"] = float(np.mean([s["reward"] for s in flat]))
        block["truncated"] = float(np.mean([s["finish_reason"] == "length" for s in flat]))
        block["mean_response_tokens"] = float(np.mean([s["response_tokens"] for s in flat]))
        greedy = [s["reward"] for group in prompts.values() for s in group if s["greedy"]]
        if greedy:
            block["greedy"] = float(is_correct(greedy).mean())
        benchmarks[source] = block
    metrics = [f"pass@{k}" for k in ks] + (["greedy"] if any("greedy" in b for b in benchmarks.values()) else [])
    average = {m: float(np.mean([b[m] for b in benchmarks.values()])) for m in metrics} if benchmarks else {}
    return {"benchmarks": benchmarks, "average": average}


def results_document(blocks: Dict[str, Dict]) -> Dict:
    """results.json: the block itself for one model, else one block per model keyed by its path."""
    return next(iter(blocks.values())) if len(blocks) == 1 else blocks


def render_table(blocks: Dict[str, Dict], ks: Sequence[int]) -> str:
    """The papers' table: one row per model, one column per benchmark and the average, cells pass@k in % joined
    by " / " in increasing k."""
    sources: List[str] = []
    for block in blocks.values():
        sources += [s for s in block["benchmarks"] if s not in sources]
    metric = " / ".join(f"pass@{k}" for k in ks)
    header = ["model", *sources, "average"]
    rows = [
        f"Unbiased {metric} (%), from n = "
        f"{', '.join(sorted({str(b['n']) for bl in blocks.values() for b in bl['benchmarks'].values()}))} "
        "samples per prompt.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]

    def cell(values):
        return " / ".join(f"{100 * values[f'pass@{k}']:.1f}" for k in ks) if values else "-"

    for model, block in blocks.items():
        cells = [cell(block["benchmarks"].get(s)) for s in sources] + [cell(block["average"])]
        rows.append("| " + " | ".join([model, *cells]) + " |")
    return "\n".join(rows) + "\n"


def write_results(out: str, blocks: Dict[str, Dict], ks: Sequence[int]) -> Dict:
    document = results_document(blocks)
    with open(os.path.join(out, RESULTS_JSON), "w") as f:
        json.dump(document, f, indent=1)
    with open(os.path.join(out, RESULTS_MD), "w") as f:
        f.write(render_table(blocks, ks))
    return document
