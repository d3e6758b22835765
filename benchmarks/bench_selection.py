"""Time select_rollouts(rule="max_var") against a PODS-style reference.

Run from the repository root:

    .venv/bin/python benchmarks/bench_selection.py

It prints a markdown table and overwrites benchmarks/RESULTS_selection.md with it.

Second part (threads and load): select_rollouts(randn(1024, 64), 16 * 1024, scope="cross") as a ratio to one
np.sort of the same 65,536 float32 values, both timed alternately in this process: with one torch thread, with
torch's default thread setting, and with the default setting while a busy-loop process (started here) keeps
another core busy. Median and p95 over --load-repeats runs. Target: ratio <= 3 idle and loaded.

The reference is written here after the description of PODS's published code in issue 2: a Python loop
over the groups; in each group a sort, then every split i = 0..m is scored by building the candidate subset
(the i smallest and the m - i largest values: torch.cat) and computing its variance (torch.var, .item()),
O(m) per candidate. For cross scope it runs the same algorithm once on the pooled B*G values. Keep counts:
m = G/4 per prompt (intra), m = B*G/4 in total (cross). Targets: >= 100x the reference at (512, 64), and
under 5 ms for (1024, 64) cross.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from d3s_openrlhf.core.selection import select_rollouts

SHAPES = ((128, 8), (512, 16), (512, 64), (1024, 64))
RESULTS = Path(__file__).resolve().parent / "RESULTS_selection.md"


def reference_max_var(group: torch.Tensor, m: int) -> torch.Tensor:
    """PODS-style max-variance selection of one 1-D group: sort, then O(m) work per candidate split.

    In float64, so that it is exact and its choice can be checked against ours.
    """
    group = group.double()
    n = group.numel()
    order = torch.argsort(group)
    sorted_group = group[order]
    best_var, best_i = float("-inf"), 0
    for i in range(m + 1):
        candidate = torch.cat([sorted_group[:i], sorted_group[n - (m - i) :]])
        var = candidate.var(unbiased=False).item()
        if var > best_var:
            best_var, best_i = var, i
    return torch.cat([order[:best_i], order[n - (m - best_i) :]])


def reference_select(values: torch.Tensor, keep: int, scope: str) -> torch.Tensor:
    """Sorted flat indices, like select_rollouts(values, keep, scope=scope, rule="max_var")."""
    if scope == "cross":
        return reference_max_var(values.reshape(-1), keep).sort().values
    group_size = values.shape[1]
    picked = [reference_max_var(row, keep) + b * group_size for b, row in enumerate(values)]
    return torch.cat(picked).sort().values


def kept_variance(values: torch.Tensor, indices: torch.Tensor, keep: int, scope: str) -> torch.Tensor:
    """Variance of the kept values: pooled for cross, per row for intra."""
    kept = values.reshape(-1)[indices].double()
    return kept.var(unbiased=False) if scope == "cross" else kept.view(-1, keep).var(dim=1, unbiased=False)


def median_ms(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ratio_to_np_sort(values: torch.Tensor, keep: int, generator, repeats: int) -> dict:
    """Median and p95 (ms) of select_rollouts(cross) and of np.sort of the same values, timed alternately, and
    the ratio of the medians and of the p95s."""
    flat = values.reshape(-1).numpy().copy()
    ours, sort = [], []
    for i in range(repeats + 10):
        start = time.perf_counter()
        select_rollouts(values, keep, scope="cross", generator=generator)
        middle = time.perf_counter()
        np.sort(flat)
        end = time.perf_counter()
        if i >= 10:  # warm-up
            ours.append(middle - start)
            sort.append(end - middle)
    def q(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3
    row = {"ours_ms": q(ours, 0.5), "ours_p95_ms": q(ours, 0.95), "sort_ms": q(sort, 0.5), "sort_p95_ms": q(sort, 0.95)}
    row["ratio"] = row["ours_ms"] / row["sort_ms"]
    row["ratio_p95"] = row["ours_p95_ms"] / row["sort_p95_ms"]
    return row


def thread_and_load_rows(repeats: int, seed: int) -> list:
    values = torch.randn(1024, 64, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 1)
    default_threads = torch.get_num_threads()
    rows = []
    try:
        torch.set_num_threads(1)
        rows.append({"setting": "1 thread, idle", **ratio_to_np_sort(values, 16 * 1024, generator, repeats)})
    finally:
        torch.set_num_threads(default_threads)
    rows.append(
        {"setting": f"default ({default_threads} threads), idle", **ratio_to_np_sort(values, 16 * 1024, generator, repeats)}
    )
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        rows.append(
            {
                "setting": f"default ({default_threads} threads), busy loop beside",
                **ratio_to_np_sort(values, 16 * 1024, generator, repeats),
            }
        )
    finally:
        busy.kill()
        busy.wait()
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50, help="timed runs of select_rollouts per cell")
    parser.add_argument("--ref-repeats", type=int, default=5, help="timed runs of the reference per cell")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine a second thread that gets descheduled "
        "makes every parallel op wait for it, which dominates the timings)",
    )
    parser.add_argument("--load-repeats", type=int, default=300, help="timed runs per thread/load setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS, help="results file (overwritten)")
    parser.add_argument(
        "--json", type=Path, default=RESULTS.parent / "results" / "selection.json", help="the rows, for report.py"
    )
    args = parser.parse_args()
    load_rows = thread_and_load_rows(args.load_repeats, args.seed)
    for row in load_rows:
        print(f"  {row['setting']}: {row['ours_ms']:.3f} ms (p95 {row['ours_p95_ms']:.3f}), np.sort "
              f"{row['sort_ms']:.3f} ms (p95 {row['sort_p95_ms']:.3f}); ratio {row['ratio']:.1f} (p95 {row['ratio_p95']:.1f})")
    torch.set_num_threads(args.threads)

    data_gen = torch.Generator().manual_seed(args.seed)
    select_gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for num_prompts, group_size in SHAPES:
        values = torch.randn(num_prompts, group_size, generator=data_gen)
        for scope in ("intra", "cross"):
            keep = group_size // 4 if scope == "intra" else num_prompts * group_size // 4
            ours = select_rollouts(values, keep, scope=scope, generator=select_gen)
            ref = reference_select(values, keep, scope)
            torch.testing.assert_close(
                kept_variance(values, ours, keep, scope), kept_variance(values, ref, keep, scope), rtol=1e-9, atol=1e-12
            )
            ours_ms = median_ms(
                lambda: select_rollouts(values, keep, scope=scope, generator=select_gen), args.repeats, warmup=5
            )
            ref_ms = median_ms(lambda: reference_select(values, keep, scope), args.ref_repeats, warmup=1)
            rows.append((num_prompts, group_size, scope, keep, ours_ms, ref_ms))
            print(f"  B={num_prompts} G={group_size} {scope}: ours {ours_ms:.3f} ms, reference {ref_ms:.1f} ms")

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    speedup = {(b, g, scope): ref_ms / ours_ms for b, g, scope, _, ours_ms, ref_ms in rows}
    cross_big_ms = next(ours_ms for b, g, scope, _, ours_ms, _ in rows if (b, g, scope) == (1024, 64, "cross"))
    lines = [
        "# select_rollouts benchmark (rule=max_var)",
        "",
        "Command: `.venv/bin/python benchmarks/bench_selection.py` (from the repository root).",
        "",
        f"- Date: {now}",
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}; load average at the "
        f"end {os.getloadavg()[0]:.2f} (the machine is shared)",
        "- Values: float32 standard normal, shape (B, G). Keep: G/4 per prompt (intra), B*G/4 in total (cross).",
        f"- Median of {args.repeats} runs (ours) and {args.ref_repeats} runs (reference), after warm-up runs.",
        "- Reference: PODS-style, a Python loop over groups (cross: one pooled group), a sort per group, then the",
        "  variance of every candidate subset (i smallest + m-i largest) in O(m) with torch ops, in float64.",
        "- Both pick subsets of equal variance (checked before timing).",
        f"- Targets: >= 100x at (512, 64): intra {speedup[512, 64, 'intra']:.0f}x, cross "
        f"{speedup[512, 64, 'cross']:.0f}x; < 5 ms at (1024, 64) cross: {cross_big_ms:.2f} ms.",
        "",
        "| B | G | scope | kept | ours (ms) | reference (ms) | speedup |",
        "|---:|---:|:---|---:|---:|---:|---:|",
    ]
    for num_prompts, group_size, scope, keep, ours_ms, ref_ms in rows:
        kept = num_prompts * keep if scope == "intra" else keep
        cells = (num_prompts, group_size, scope, kept, f"{ours_ms:.3f}", f"{ref_ms:.1f}", f"{ref_ms / ours_ms:,.0f}x")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "## Threads and load: (1024, 64) cross as a ratio to one np.sort of the same 65,536 float32 values",
        "",
        f"Both timed alternately in one process, {args.load_repeats} runs each after 10 warm-up runs; the busy loop",
        "is a `python -c 'while True: pass'` process started by the benchmark. Target: ratio <= 3.",
        "",
        "| setting | ours median (ms) | ours p95 (ms) | np.sort median (ms) | np.sort p95 (ms) | ratio median | ratio p95 |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in load_rows:
        lines.append(
            f"| {row['setting']} | {row['ours_ms']:.3f} | {row['ours_p95_ms']:.3f} | {row['sort_ms']:.3f} | "
            f"{row['sort_p95_ms']:.3f} | {row['ratio']:.1f} | {row['ratio_p95']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    args.output.write_text(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    keys = ("prompts", "group", "scope", "keep", "ours_ms", "reference_ms")
    args.json.write_text(json.dumps({"date": now, "rows": [dict(zip(keys, row)) for row in rows], "threads_and_load": load_rows}, indent=1))
    print(f"written to {args.output} and {args.json}")


if __name__ == "__main__":
    main()
