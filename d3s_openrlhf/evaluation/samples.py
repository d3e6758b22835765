"""The samples file, ``DIR/samples.jsonl``: one JSON line per sample, a prompt's lines appended in one write once the
prompt is complete (all its samples generated and scored), so that an interrupted run loses at most the prompts in
flight and a rerun continues with the prompts not yet complete.

A line: ``model`` (its absolute path, ``inputs.model_key``), ``model_digest`` (``inputs.model_digest`` of the
model's files it was generated with), ``index`` (the prompt's position over all data files), ``row_digest``
(``inputs.row_digest`` of the row it answers), ``datasource``, ``prompt`` (the text the model was given), ``label``,
``sample`` (0 .. n-1; n for the greedy sample), ``greedy``, ``response``, ``response_tokens``, ``reward``,
``finish_reason``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Dict, List, Sequence, Tuple

SAMPLES_FILE = "samples.jsonl"

Key = Tuple[str, int]  # (model, prompt index)


def read_complete(path: str, per_prompt: int) -> Dict[Key, List[dict]]:
    """The complete prompts of the file: ``{(model, index): lines}`` with ``per_prompt`` distinct samples each.

    A run killed inside a write leaves a cut last line and, at most, part of one prompt's lines: those are
    dropped, and the file is rewritten without them (so that the next appends start on a fresh line).
    """
    if not os.path.exists(path):
        return {}
    groups: Dict[Key, Dict[int, dict]] = {}
    dropped = 0
    with open(path) as f:
        for text in f:
            try:
                line = json.loads(text)
                key = (line["model"], int(line["index"]))
                groups.setdefault(key, {})[int(line["sample"])] = line
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                dropped += 1
    complete = {key: [lines[s] for s in sorted(lines)] for key, lines in groups.items() if len(lines) == per_prompt}
    if dropped or len(complete) < len(groups):
        _rewrite(path, complete)
    return complete


def _rewrite(path: str, complete: Dict[Key, List[dict]]) -> None:
    """Replace the file by the lines of ``complete`` (through a temporary file: a kill leaves the old or the new)."""
    partial = os.path.join(os.path.dirname(path), f".{SAMPLES_FILE}.tmp")
    with open(partial, "w") as f:
        for lines in complete.values():
            f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(partial, path)


def append_prompt(file, lines: List[dict]) -> None:
    """Append one complete prompt's lines in one write, then flush (a kill leaves them whole or cut at the end)."""
    file.write("".join(json.dumps(line) + "\n" for line in lines))
    file.flush()


def resume(
    out: str, per_prompt: int, rows: Sequence, model_digests: Dict[str, str]
) -> Tuple[Dict[Key, List[dict]], Dict[str, int]]:
    """The complete prompts of ``out``'s samples file (``read_complete``) that answer the models and the data as they
    are now, and per model the number of prompts dropped from the file to be generated again.

    A prompt generated from other files than its model's now (``model_digests``: model key -> ``inputs.model_digest``;
    a checkpoint saved over in place by a run that went on) is dropped. Each prompt kept is checked against the row
    now at its index (``rows``: ``inputs.Row``): a data file regenerated in place, reordered, cut or with other rows
    would otherwise have its old samples reported under the new rows. Refuses the first differing index, and lines
    without either digest (written before the evaluator kept it)."""
    path = os.path.join(out, SAMPLES_FILE)
    complete = read_complete(path, per_prompt)
    redo = f"give another --out, or delete {path} to generate them again"
    for name, against in (("model_digest", "the model's files"), ("row_digest", "--data")):
        if any(name not in line for lines in complete.values() for line in lines):
            raise ValueError(
                f"{path}: samples without {name} (written before the evaluator checked them against {against}), "
                f"so they cannot be matched to it: {redo}"
            )
    stale = [
        key for key, lines in complete.items() if {line["model_digest"] for line in lines} != {model_digests[key[0]]}
    ]
    if stale:
        for key in stale:
            del complete[key]
        _rewrite(path, complete)
    for (_, index), lines in sorted(complete.items(), key=lambda item: item[0][1]):
        if index >= len(rows):
            raise ValueError(
                f"{path}: samples at index {index}, but --data has {len(rows)} prompts now (the data changed since "
                f"they were generated): {redo}"
            )
        if {line["row_digest"] for line in lines} != {rows[index].digest}:
            raise ValueError(
                f"{path}: the samples at index {index} were generated for another row than {rows[index].where} "
                f"holds now (its prompt, label or datasource differs): {redo}"
            )
    return complete, dict(Counter(model for model, _ in stale))
