"""Turn the benchmark results into ``benchmarks/RESULTS.md`` with its plots (``benchmarks/results/*.png``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results]

Reads ``step_cost.json`` (bench_step_cost.py), ``learning_study.json`` (bench_learning.py, section 2),
``selection.json`` (bench_selection.py), ``memory.json``, ``forward.json``, ``forward_gpu.json`` (where a GPU
ran it), ``evaluate.json`` (bench_evaluate.py, section 7), ``screening.json`` (bench_screening.py, section 8),
``lora_sync_before.json`` / ``lora_sync_after.json`` (bench_lora_sync.py, section 9), for section 10
``gpu_h200_2026-11-26.json`` (the team's H200 measurement), ``actor_gpu*.json`` (bench_actor_gpu.py) and
``cuda_tests.json`` (the suite's CUDA tests on a GPU machine), ``speed_study.json`` (bench_speed.py, where it ran:
section 11, and its generation-level arms section 6) and ``generation_study.json`` (bench_learning.py --parts
screen, the generation level's first study at one rate, section 12). ``--study learning_study.json --output STUDY.md``
instead writes the study alone (tables, Welch tests, the claims, ``STUDY.png``); ``--speed speed_study.json
--output SPEED.md`` the speed study alone, with its plots beside it. Every number, comparison and verdict in the
document is computed from those files (by ``benchmarks/reporting/``; this file parses the command line and assembles
the document), so a rerun of ``benchmarks/run_all.sh`` regenerates the whole document consistently.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reporting.claims import claims  # benchmarks/ is sys.path[0] when this file runs
from reporting.generation_study import generation_section
from reporting.gpu import gpu_actor_section, gpu_forward_section
from reporting.screening import screening_section
from reporting.sections import (
    evaluate_section,
    forward_section,
    lora_sync_section,
    memory_section,
    plot_step_cost,
    selection_section,
    step_cost_section,
    summary,
)
from reporting.speed_doc import generation_level_section, speed_main, speed_section
from reporting.study import study_analysis
from reporting.study_doc import plot_study, study_body

HERE = Path(__file__).resolve().parent


def read_study(path):
    """The study of ``path`` (learning_study.json) with its analysis and its claims: ``(document, parts, found)``."""
    document = json.loads(Path(path).read_text())
    parts = study_analysis(document)
    return document, parts, claims(parts, document["eval_every"])


def study_main(path, output):
    """Write the study of ``path`` alone to ``output`` and its plot beside it (``.png``); returns ``output``."""
    document, parts, found = read_study(path)
    plot_path = Path(output).with_suffix(".png")
    plot_study(parts, plot_path)
    body = study_body(document, parts, plot_path.name, found)
    lines = [f"# Learning-efficiency study on `{document['task']}`", "", *body]
    Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output} and {plot_path}")
    return output


def study_section(results):
    """Section 2 of RESULTS.md from ``results/learning_study.json``, the analysed parts and the claims (None, None
    if not run)."""
    path = results / "learning_study.json"
    heading = "## 2. Learning efficiency: the study"
    if not path.exists():
        return (
            [heading, "", "Not run yet: `.venv/bin/python benchmarks/bench_learning.py` (see its docstring)."],
            None,
            None,
        )
    document, parts, found = read_study(path)
    plot_study(parts, results / "learning_study.png")
    lines = [heading, "", *study_body(document, parts, "results/learning_study.png", found, heading="###")]
    return lines, parts, found


def gpu_actor_documents(results):
    """Section 10's measurements, by label: the team's H200 file, then every bench_actor_gpu.py result."""
    documents = {}
    for path in sorted(results.glob("gpu_*.json")):
        document = json.loads(path.read_text())
        documents[f"{document['machine']}, {document['date']}: the team's first GPU run"] = document
    for path in sorted(results.glob("actor_gpu*.json")):
        document = json.loads(path.read_text())
        documents[f"{document['machine']}, {document['date']}: `{path.name}`"] = document
    return documents


def main(argv=None):
    """RESULTS.md and its plots from the files in ``--results``; with ``--study``, the study alone."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    parser.add_argument(
        "--study",
        default=None,
        help="instead: the study report of this learning_study.json (bench_learning.py), written to --output",
    )
    parser.add_argument(
        "--speed", default=None, help="instead: the report of this speed_study.json (bench_speed.py), to --output"
    )
    options = parser.parse_args(argv)
    if options.study:
        return study_main(options.study, options.output)
    if options.speed:
        return speed_main(options.speed, options.output)
    results = Path(options.results)
    selection = json.loads((results / "selection.json").read_text())
    cost = json.loads((results / "step_cost.json").read_text())
    plot_step_cost(cost["points"], results / "step_cost.png")
    study, parts, found = study_section(results)
    speed_path = results / "speed_study.json"
    speed, speed_summary = speed_section(speed_path, 11)
    level, level_summary = generation_level_section(speed_path, 6)
    document = [
        "# Benchmarks: what D3S costs and saves",
        "",
        "Regenerate everything: `bash benchmarks/run_all.sh` (its header says how long each part takes on 2 CPU "
        "cores). Each section names its own command, machine and date. Sections 1-9 ran on 2 CPU cores; the GPU "
        "figures are in section 5 (On a GPU) and section 10, each with its card.",
        "",
        *summary(cost, parts, found),
        *speed_summary,
        *level_summary,
        "",
        *step_cost_section(cost),
        "",
        *study,
        "",
        *selection_section(selection, cost, parts),
        "",
    ]
    if (results / "memory.json").exists():
        document += [*memory_section(json.loads((results / "memory.json").read_text())), ""]
    if (results / "forward.json").exists():
        document += [*forward_section(json.loads((results / "forward.json").read_text())), ""]
        gpu = results / "forward_gpu.json"
        document += [*gpu_forward_section(json.loads(gpu.read_text()) if gpu.exists() else None), ""]
    document += [*level, ""]
    if (results / "evaluate.json").exists():
        document += [*evaluate_section(json.loads((results / "evaluate.json").read_text()), 7), ""]
    if (results / "screening.json").exists():
        document += [*screening_section(json.loads((results / "screening.json").read_text()), 8), ""]
    if (results / "lora_sync_after.json").exists():
        before, after = (json.loads((results / f"lora_sync_{side}.json").read_text()) for side in ("before", "after"))
        document += [*lora_sync_section(before, after, 9), ""]
    cuda_tests = results / "cuda_tests.json"
    cuda_tests = json.loads(cuda_tests.read_text()) if cuda_tests.exists() else None
    document += [*gpu_actor_section(gpu_actor_documents(results), 10, cuda_tests), ""]
    document += [*speed, ""]
    if (results / "generation_study.json").exists():
        document += [*generation_section(results / "generation_study.json", 12), ""]
    Path(options.output).write_text("\n".join(document))
    print(f"wrote {options.output} and the plots in {results}")


if __name__ == "__main__":
    main()
