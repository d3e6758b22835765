"""Turn the benchmark results into ``benchmarks/RESULTS.md`` with its plots (``benchmarks/results/*.png``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results] [--output benchmarks/RESULTS.md]
    .venv/bin/python benchmarks/report.py --speed OUT/speed_study.json --output OUT/speed_study.md  # that study alone

Reads, in ``--results``: ``speed_study.json`` (bench_speed.py, section 1), ``step_cost.json`` (bench_step_cost.py,
section 2), ``selection.json`` (bench_selection.py, section 3), ``memory.json`` (bench_memory.py, section 4),
``forward.json`` and ``forward_gpu.json`` (bench_forward.py and, where a GPU ran it, bench_forward_gpu.py, section
5), for section 6 ``gpu_h200_2026-11-26.json`` (the team's H200 measurement), ``actor_gpu*.json``
(bench_actor_gpu.py) and ``cuda_tests.json`` (the suite's CUDA tests on a GPU machine), ``evaluate.json``
(bench_evaluate.py, section 7), ``lora_sync_merged.json`` / ``lora_sync_adapter.json`` (bench_lora_sync.py,
section 8), ``equal_updates.json`` (bench_speed.py ``--name equal_updates``, section 9). Every number, comparison
and line of the head is computed from those files (by ``benchmarks/reporting/``; this file parses the command line
and assembles the document), so a rerun of ``benchmarks/run_all.sh`` regenerates the whole document consistently.
The studies it superseded are static text in ``benchmarks/SUPERSEDED.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reporting import gpu, sections, speed  # benchmarks/ is sys.path[0] when this file runs

HERE = Path(__file__).resolve().parent
NUMBERS = {
    name: number
    for number, name in enumerate(
        ("speed", "step_cost", "selection", "memory", "forward", "actor_gpu", "evaluate", "lora_sync", "equal_updates"),
        1,
    )
}


def read(results, name):
    """``results/name`` as JSON, None where that benchmark has not run."""
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def gpu_actor_documents(results):
    """Section 6's measurements, by label: the team's H200 file, then every bench_actor_gpu.py result."""
    documents = {}
    for path in sorted(results.glob("gpu_*.json")):
        document = json.loads(path.read_text())
        documents[f"{document['machine']}, {document['date']}: the team's first GPU run"] = document
    for path in sorted(results.glob("actor_gpu*.json")):
        document = json.loads(path.read_text())
        documents[f"{document['machine']}, {document['date']}: `{path.name}`"] = document
    return documents


def results_document(results):
    """RESULTS.md's lines: the head (what stands today, one line per section), then the sections."""
    cost, selection = read(results, "step_cost.json"), read(results, "selection.json")
    memory, forward, forward_gpu = (read(results, name) for name in ("memory.json", "forward.json", "forward_gpu.json"))
    evaluate, cuda_tests = read(results, "evaluate.json"), read(results, "cuda_tests.json")
    merged, adapter = (read(results, f"lora_sync_{label}.json") for label in ("merged", "adapter"))
    lora_sync = None if adapter is None or merged is None else (merged, adapter)
    actor_documents = gpu_actor_documents(results)
    sections.plot_step_cost(cost["points"], results / "step_cost.png")
    speed_lines, speed_head = speed.speed_section(results / "speed_study.json", NUMBERS["speed"])
    equal_lines, equal_head = speed.speed_section(results / "equal_updates.json", NUMBERS["equal_updates"])
    lines = [
        "# Benchmarks: what D3S costs and saves",
        "",
        "Regenerate everything: `bash benchmarks/run_all.sh` (its header says how long each part takes on 2 CPU "
        "cores); this page alone, from the results: `.venv/bin/python benchmarks/report.py`. Each section names its "
        f"own command, machine and date; the GPU figures are in sections {NUMBERS['forward']} (On a GPU) and "
        f"{NUMBERS['actor_gpu']}, each with its card, the rest ran on 2 CPU cores. The studies these superseded (the "
        "learning study at one shared rate, the generation level's first study, screening) are kept as they were "
        "reported, with their figures, in [SUPERSEDED.md](SUPERSEDED.md).",
        "",
        "**What stands today.**",
        *speed_head,
        *equal_head,
        *sections.head_lines(cost, memory, evaluate, lora_sync, NUMBERS),
        *gpu.head_lines(forward_gpu, actor_documents, NUMBERS),
        "",
        *speed_lines,
        "",
        *sections.step_cost_section(cost, NUMBERS["step_cost"]),
        "",
        *sections.selection_section(selection, cost, NUMBERS["selection"]),
    ]
    if memory is not None:
        lines += ["", *sections.memory_section(memory, NUMBERS["memory"])]
    if forward is not None:
        lines += ["", *sections.forward_section(forward, NUMBERS["forward"]), "", *gpu.gpu_forward_section(forward_gpu)]
    lines += ["", *gpu.gpu_actor_section(actor_documents, NUMBERS["actor_gpu"], cuda_tests)]
    if evaluate is not None:
        lines += ["", *sections.evaluate_section(evaluate, NUMBERS["evaluate"])]
    if lora_sync is not None:
        lines += ["", *sections.lora_sync_section(merged, adapter, NUMBERS["lora_sync"])]
    return lines + ["", *equal_lines]


def main(argv=None):
    """RESULTS.md and its plots from the files in ``--results``; with ``--speed``, that speed study alone."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    parser.add_argument(
        "--speed", default=None, help="instead: the report of this speed_study.json (bench_speed.py), to --output"
    )
    options = parser.parse_args(argv)
    if options.speed:
        return speed.speed_main(options.speed, options.output)
    Path(options.output).write_text("\n".join(results_document(Path(options.results))) + "\n")
    print(f"wrote {options.output} and the plots in {options.results}")
    return options.output


if __name__ == "__main__":
    main()
