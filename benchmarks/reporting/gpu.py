"""The GPU sections of RESULTS.md: the log-prob forwards at the LM head (bench_forward_gpu.py, under section 5) and
the actor's step through OpenRLHF's ``Actor`` (bench_actor_gpu.py and the team's H200 measurement, its own
section). A cell is ``{"peak_mib", "seconds"}`` (the benchmarks') or ``{"peak_mib", "ms"}`` (the H200 file's)."""

from __future__ import annotations

import re

FORWARD_COMMAND = "`PYTHONPATH=$PWD python benchmarks/bench_forward_gpu.py`"
ACTOR_COMMAND = "`PYTHONPATH=$PWD python benchmarks/bench_actor_gpu.py`"
NEEDS = "torch, transformers, deepspeed, flash-attn and openrlhf; no Ray or vLLM"


def _ms(cell) -> float:
    return cell["ms"] if "ms" in cell else cell["seconds"] * 1e3


def _gib(cell) -> float:
    return cell["peak_mib"] / 1024


def _card(document) -> str:
    """The card's name in a document's machine: "NVIDIA H200 (cuda), torch ..." -> "NVIDIA H200"."""
    return document["machine"].split(",")[0].split(" (")[0]


def _versions(document) -> str:
    versions = document.get("versions", {})
    shown = {name: v for name, v in versions.items() if v and f"{name} {v}" not in document.get("machine", "")}
    return ", ".join(f"{name} {version}" for name, version in shown.items())


def gpu_forward_section(forward_gpu):
    """The head-level comparison on a GPU (bench_forward_gpu.py), or how to get it where it has not run."""
    lines = ["### On a GPU", ""]
    if forward_gpu is None:
        return lines + [
            f"Not run yet. {FORWARD_COMMAND} ({NEEDS}) writes `benchmarks/results/forward_gpu.json` and its table "
            "(Qwen2.5-7B's vocabulary and hidden size, bf16, T = 1k to 8k, K = 0.05, 0.2, 1, KL loss off and on), "
            "which `report.py` then puts here."
        ]
    lines += [
        f"Command: {FORWARD_COMMAND} ({forward_gpu['date']}, {forward_gpu['machine']}; {_versions(forward_gpu)}; "
        f"{forward_gpu['model']}). Upstream ran OpenRLHF's own `log_probs_from_logits` on its "
        f"**{forward_gpu['upstream_path']}** path.",
        "",
        "| T | KL loss | variant | peak MiB | × upstream | ms | × upstream |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for row in forward_gpu["rows"]:
        for kl, cells in row["training"].items():
            base = cells["upstream"]
            for name, cell in cells.items():
                lines.append(
                    f"| {row['tokens']:,} | {kl} | {name} | {cell['peak_mib']:,.0f} | "
                    f"{cell['peak_mib'] / base['peak_mib']:.2f} | {_ms(cell):.1f} | {_ms(cell) / _ms(base):.2f} |"
                )
    return lines


def actor_rows(document):
    """``(name, row)`` of every actor-step measurement of a document: bench_actor_gpu.py's ``shapes``, or the H200
    file's runs (every part with a ``config``)."""
    if "shapes" in document:
        return list(document["shapes"].items())
    return [
        (re.sub(r"^[A-Z] actor step ", "", name), row)  # the script's part letter: "F actor step Qwen2.5-7B shape"
        for run in ("actor_step", "actor_step_full_depth", "actor_step_checkpointing")
        for name, row in document["runs"].get(run, {}).items()
    ]


def _actor_table(rows):
    lines = [
        "| shape | batch | upstream | ours, every token | ours, K = 0.2 | body alone | peak GiB: upstream / every / "
        "K = 0.2 / body | experience fwd: upstream / ours |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for name, row in rows:
        cells = [row[f"train step: {v}"] for v in ("upstream", "ours all tokens", "ours K=0.2", "body only (no head)")]
        upstream = _ms(cells[0])
        times = [f"{upstream:.0f} ms"] + [f"{_ms(c):.0f} ms ({_ms(c) / upstream:.2f}x)" for c in cells[1:3]]
        experience = [row[f"experience fwd (entropy): {side}"] for side in ("upstream", "ours")]
        model, batch = row["config"].split("; ", 1)
        lines.append(
            f"| {name} ({model}) | {batch} | {' | '.join(times)} | {_ms(cells[3]):.0f} ms | "
            f"{' / '.join(f'{_gib(c):.1f}' for c in cells)} | "
            f"{_ms(experience[0]):.0f} / {_ms(experience[1]):.0f} ms, "
            f"{_gib(experience[0]):.1f} / {_gib(experience[1]):.1f} GiB |"
        )
    return lines


def _kernel_table(anchors):
    lines = [
        "| N, H | 3 head matmuls (the floor) | ours | upstream, Triton CE | upstream, torch fallback | Liger FLCE "
        "(no entropy) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in anchors.items():
        cells = ("ours fwd+bwd", "upstream triton fwd+bwd", "upstream torch fwd+bwd", "liger flce fwd+bwd")
        lines.append(
            f"| {name} | {_ms(row['floor 3 matmuls']):.0f} ms | "
            + " | ".join(f"{_ms(row[c]):.0f} ms, {_gib(row[c]):.1f} GiB" for c in cells)
            + " |"
        )
    return lines


def cuda_tests_line(run) -> str:
    """The suite's CUDA tests on a GPU machine (``results/cuda_tests.json``), or how to run them."""
    if run is None:
        return f"The suite's CUDA tests: `pytest -m cuda tests/core tests/cuda` ({NEEDS}); not run on a GPU yet."
    return (
        f"The suite's CUDA tests, `{run['command']}`, on {run['machine']} ({run['date']}; {_versions(run)}; without "
        f"{' or '.join(run['without'])}): {run['passed']} passed, {run['skipped']} skipped, {run['failed']} failed "
        f"in {run['seconds']:.0f} s."
    )


def gpu_actor_section(documents, number, cuda_tests=None):
    """The actor's training step through OpenRLHF's ``Actor`` on a GPU: one table per document (label -> the H200
    file or a bench_actor_gpu.py result), the H200 file's kernel anchors and CUDA equality beside it; first the line
    of the suite's CUDA tests (``cuda_tests``: results/cuda_tests.json, or None)."""
    lines = [
        f"## {number}. The actor's step on a GPU: OpenRLHF's `Actor` against chunked logits",
        "",
        "A Qwen2 model with Qwen2.5's 151,936-token vocabulary and an untied head (random weights, bf16, sdpa), in "
        "OpenRLHF's `Actor`; forward and backward of PPO-clip. Upstream: `Actor.forward`, the fp32 logits of every "
        "position through its GPU log-prob path. Ours: `training_forward` at every action token (what a KL loss, "
        "GSPO or K = 1 with `--d3s.chunked_logits` run) and at the top 20% of the tokens (K = 0.2, PPO-clip alone). "
        "The body alone is the part of the step every variant shares. Peaks above the weights and gradients. "
        "Compare variants within one table: the same shape on the same card took different absolute times in the "
        "two sessions below, the body alone included.",
        "",
        cuda_tests_line(cuda_tests),
        "",
    ]
    if not documents:
        return lines + [f"Not run yet: {ACTOR_COMMAND} ({NEEDS}) writes `benchmarks/results/actor_gpu.json`."]
    for label, document in documents.items():
        lines += [
            f"### {label}",
            "",
            f"{document['machine']}, {document['date']}; {_versions(document)}. Upstream's log-prob path: "
            f"**{document['upstream_path']}**."
            + (
                f" Source: {document['source']}."
                if "source" in document
                else f" Command: {ACTOR_COMMAND[:-1]}{''.join(' ' + arg for arg in document['argv'])}`."
            ),
            "",
            *_actor_table(actor_rows(document)),
            "",
        ]
        anchors = document.get("runs", {}).get("kernel_anchors", {}).get("A kernel anchors")
        if anchors:
            lines += [
                "The LM head alone (bf16 hidden states (N, H), head (151,936, H), temperature 0.6, loss "
                "sum(A · log p), forward and backward; time, peak):",
                "",
                *_kernel_table(anchors),
                "",
            ]
        equality = document.get("runs", {}).get("actor_equality", {}).get("B tiny actor equality")
        if equality:
            held = [name for name, cell in equality.items() if cell["equal"] is True]
            worst = max(cell["max |lp diff|"] for cell in equality.values())
            lines += [
                f"`training_forward` against `Actor.forward` on CUDA (the suite's tiny Llama): equal in values and "
                f"gradients in {len(held)} of {len(equality)} cases ({', '.join(equality)}); largest log-prob "
                f"difference {worst:.1e}.",
                "",
            ]
    return lines[:-1]


def head_lines(forward_gpu, actor_documents, numbers):
    """RESULTS.md's head lines of the GPU measurements (``numbers``: section name -> its number): the head-level
    forward at its longest T without a KL loss, and the range over every shape of the actor's step time against
    upstream's."""
    lines = []
    if forward_gpu is not None:
        row = forward_gpu["rows"][-1]
        cells = row["training"]["kl off"]
        base, ours = cells["upstream"], cells["ours 0.2"]
        lines.append(
            f"- Log-probs from the hidden states on a GPU (section {numbers['forward']}, {_card(forward_gpu)}): at "
            f"T = {row['tokens']:,}, K = 0.2 and no KL loss, {ours['peak_mib'] / base['peak_mib']:.2f}x upstream's "
            f"peak and {_ms(ours) / _ms(base):.2f}x its time (upstream on its {forward_gpu['upstream_path']} path)."
        )
    rows = [row for document in actor_documents.values() for _, row in actor_rows(document)]
    if rows:

        def ratios(variant):
            values = [_ms(row[f"train step: {variant}"]) / _ms(row["train step: upstream"]) for row in rows]
            return f"{min(values):.2f}-{max(values):.2f}x"

        cards = ", ".join(sorted({_card(document) for document in actor_documents.values()}))
        lines.append(
            f"- The actor's training step on a GPU (section {numbers['actor_gpu']}, {cards}; {len(rows)} shapes): "
            f"{ratios('ours K=0.2')} of upstream's time at K = 0.2, {ratios('ours all tokens')} at every token."
        )
    return lines
