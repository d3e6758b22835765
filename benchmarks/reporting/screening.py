"""The screened batch's waiting time (``bench_screening.py``: ``screening.json``): pilots dispatched ahead against one
pilot per open slot."""

from __future__ import annotations


def screening_section(document, number):
    """The RESULTS.md section of ``screening.json``."""
    lines = [
        f"## {number}. Screening by pilots: how long a batch waits on its engines",
        "",
        f"Command: `{document['command']}` ({document['date']}, {document['machine']}). The real "
        f"`D3SSamplesGenerator` draws batches of B = {document['batch']} prompts x G = {document['group']} rollouts "
        f"with pilots of k = {document['pilot']} from a fake engine that serves every request after "
        f"{document['latency']} s whatever its size (a batching engine on short requests), so a batch's time in "
        "units of that latency counts the rounds of requests it waited for: 2 at the least (a pilot, then the rest "
        "of its group). `ahead` is ours (pilots in flight topped up to ceil(needed / acceptance estimate) whenever a "
        "request returns, capped so that at most B accepted pilots wait for the next batch); `one per slot` refills "
        "a screened pilot's slot with one new pilot when it returns. The "
        "first batch starts without an estimate; later batches are averaged.",
        "",
        "| pilot acceptance | arm | rounds, first batch | rounds, later batches | pilots per batch |",
        "|---:|---|---:|---:|---:|",
    ]
    for row in document["rows"]:
        lines.append(
            f"| {row['acceptance']:.0%} | {row['arm']} | {row['rounds_first']:.1f} | {row['rounds_later']:.1f} | "
            f"{row['pilots_per_batch']:.1f} |"
        )
    by = {(row["acceptance"], row["arm"]): row for row in document["rows"]}
    worst = min(by)[0]
    ahead, serial = by[(worst, "ahead")], by[(worst, "one per slot")]
    lines += [
        "",
        f"At {worst:.0%} acceptance a batch waited {ahead['rounds_later']:.1f} rounds ahead against "
        f"{serial['rounds_later']:.1f} one per slot, with {ahead['pilots_per_batch']:.0f} pilots against "
        f"{serial['pilots_per_batch']:.0f}: pilots that pass after their batch is full join the next one, so "
        "dispatching ahead costs few extra pilots. The cap on waiting pilots (one policy update old at most) is what "
        "keeps it above 2 rounds at low acceptance.",
    ]
    return lines
