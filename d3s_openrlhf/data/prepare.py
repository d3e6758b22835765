"""Turn math datasets into OpenRLHF prompt JSONL with labels, for ``d3s_openrlhf/rewards/math_reward.py``.

    python -m d3s_openrlhf.data.prepare --dataset math-lighteval --out data/train_math.jsonl
    python -m d3s_openrlhf.data.prepare --dataset eval-suite --out data/eval_math.jsonl
    python -m d3s_openrlhf.data.prepare --dataset gsm8k --input gsm8k/test.jsonl --out data/gsm8k_test.jsonl
    python -m d3s_openrlhf.data.prepare --list

Every output line is ``{"prompt": ..., "label": ..., "datasource": ...}``: train with
``--data.input_key prompt --data.label_key label --data.apply_chat_template``. ``prompt`` is the problem
followed by the Qwen2.5-Math instruction ("Please reason step by step, and put your final answer within
\\boxed{}.", the answer format the reward reads), as the user turn of the chat template; ``label`` is the bare
final answer (what math-verify compares against); ``datasource`` is the dataset's name, which OpenRLHF's
evaluation uses to report pass@k per benchmark (``eval_<datasource>_pass1``).

Sources: ``--input`` is a local ``.json`` / ``.jsonl`` / ``.parquet`` file or a directory of them (in a
directory, the files whose name contains ``--split`` when there are any, else all); without ``--input`` the
dataset is downloaded from the Hugging Face hub with ``datasets.load_dataset`` (needs internet). Rows are
kept in source order; rows with no problem or no answer are skipped and identical (prompt, label) pairs are
written once (DAPO-Math-17k's parquet repeats each problem about 100 times); both counts are reported.

Where each format keeps its answer (the first field present wins; names are matched case-insensitively):

- DAPO-Math-17k: ``reward_model.ground_truth``; the problem is the user message of ``prompt`` without DAPO's
  "Answer:" instructions (or ``prompt`` itself when it is a string, as in processed copies);
- MATH (lighteval) and Minerva: ``answer`` if present, else the last ``\\boxed{}`` of ``solution``;
- GSM8K: the text after ``####`` in ``answer`` (thousands separators removed);
- OlympiadBench: ``final_answer`` (a list: its items joined by ", ", ``$`` stripped);
- AIME24, AIME25, AMC23, MATH-500, DeepScaleR: ``answer`` (integral floats such as AMC's ``27.0`` -> ``27``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from d3s_openrlhf.rewards.math_reward import last_boxed_content

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after"
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_INTEGRAL_FLOAT = re.compile(r"^(-?\d+)\.0+$")


# -- field access ---------------------------------------------------------------------------------------------


def field(row: Mapping[str, Any], dotted: str) -> Any:
    """``row[dotted]`` with case-insensitive keys and ``a.b`` descending into nested mappings; None if absent."""
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        if key in value:
            value = value[key]
            continue
        folded = {str(k).lower(): k for k in value}
        if key.lower() not in folded:
            return None
        value = value[folded[key.lower()]]
    return value


def _text(value: Any) -> Optional[str]:
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


def normalize_label(value: Any) -> Optional[str]:
    """A label as the reward expects it: a bare answer string (``$...$`` and a whole ``\\boxed{}`` unwrapped)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = _text(value)
    if text is None:
        return None
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    if text.startswith(("\\boxed", "\\fbox")) and text.count("\\boxed") + text.count("\\fbox") == 1:
        text = last_boxed_content(text) or ""
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    integral = _INTEGRAL_FLOAT.match(text)
    if integral:
        text = integral.group(1)
    return text or None


# -- label sources ---------------------------------------------------------------------------------------------


def _plain(key: str) -> Callable[[Mapping], Optional[str]]:
    def read(row: Mapping) -> Optional[str]:
        return normalize_label(field(row, key))

    read.__name__ = key
    return read


def _boxed_solution(row: Mapping) -> Optional[str]:
    solution = _text(field(row, "solution"))
    if solution is None:
        return None
    return normalize_label(last_boxed_content(solution))


def _gsm8k_answer(row: Mapping) -> Optional[str]:
    answer = _text(field(row, "answer"))
    if answer is None or "####" not in answer:
        return None
    return normalize_label(answer.rsplit("####", 1)[1])


def _final_answer_list(row: Mapping) -> Optional[str]:
    value = field(row, "final_answer")
    if isinstance(value, (list, tuple)):
        items = [normalize_label(item) for item in value]
        items = [item for item in items if item]
        return ", ".join(items) if items else None
    return normalize_label(value)


# -- question sources --------------------------------------------------------------------------------------------


def _strip_dapo_instructions(text: str) -> str:
    if text.startswith(_DAPO_HEAD) and "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    if _DAPO_TAIL in text:
        text = text.split(_DAPO_TAIL, 1)[0]
    return text.strip()


def _question(row: Mapping, keys: Sequence[str]) -> Optional[str]:
    for key in keys:
        value = field(row, key)
        if isinstance(value, list):  # chat messages: the (last) user turn
            users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
            value = users[-1] if users else None
        text = _text(value)
        if text is not None:
            return _strip_dapo_instructions(text)
    return None


# -- the datasets ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    """How to read one dataset: where it lives on the hub and which fields hold the problem and the answer."""

    name: str
    hub_id: str
    hub_config: Optional[str]
    split: str
    labels: Tuple[Callable[[Mapping], Optional[str]], ...]
    questions: Tuple[str, ...] = ("problem", "question", "prompt", "input")
    role: str = "train"

    def label(self, row: Mapping) -> Optional[str]:
        for source in self.labels:
            label = source(row)
            if label is not None:
                return label
        return None

    def question(self, row: Mapping) -> Optional[str]:
        return _question(row, self.questions)


_ANSWER = _plain("answer")

DATASETS: Dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "dapo-math-17k",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            None,
            "train",
            (_plain("reward_model.ground_truth"), _ANSWER),
        ),
        DatasetSpec(
            "math-lighteval", "DigitalLearningGmbH/MATH-lighteval", "default", "train", (_ANSWER, _boxed_solution)
        ),
        DatasetSpec("deepscaler", "agentica-org/DeepScaleR-Preview-Dataset", None, "train", (_ANSWER, _boxed_solution)),
        DatasetSpec("gsm8k", "openai/gsm8k", "main", "train", (_gsm8k_answer,)),
        DatasetSpec("aime24", "HuggingFaceH4/aime_2024", None, "train", (_ANSWER,), role="eval"),
        DatasetSpec("aime25", "math-ai/aime25", None, "test", (_ANSWER,), role="eval"),
        DatasetSpec("amc23", "math-ai/amc23", None, "test", (_ANSWER,), role="eval"),
        DatasetSpec("math500", "HuggingFaceH4/MATH-500", None, "test", (_ANSWER, _boxed_solution), role="eval"),
        DatasetSpec("minerva", "math-ai/minervamath", None, "test", (_ANSWER, _boxed_solution), role="eval"),
        DatasetSpec(
            "olympiadbench",
            "Hothan/OlympiadBench",
            "OE_TO_maths_en_COMP",
            "train",
            (_final_answer_list, _ANSWER),
            role="eval",
        ),
    )
}

#: The paper's evaluation benchmarks (D3S Table 1), each with its evaluation split (GSM8K: test).
EVAL_SUITE: Tuple[Tuple[str, str], ...] = (
    ("aime24", "train"),
    ("aime25", "test"),
    ("amc23", "test"),
    ("gsm8k", "test"),
    ("math500", "test"),
    ("minerva", "test"),
    ("olympiadbench", "train"),
)
SUITES = {"eval-suite": EVAL_SUITE}


# -- reading -----------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Iterator[Dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # a JSON-lines file named .json
        if isinstance(data, list):
            yield from data
            return
        if isinstance(data, dict):
            columns = [value for value in data.values() if isinstance(value, list)]
            if columns and len(columns) == len(data) and len({len(c) for c in columns}) == 1:
                keys = list(data)
                for values in zip(*columns):  # column-oriented {"problem": [...], "answer": [...]}
                    yield dict(zip(keys, values))
                return
            yield data
            return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error.msg})") from None


def _read_parquet(path: Path) -> Iterator[Dict]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def local_files(path: Path, split: Optional[str]) -> List[Path]:
    """The data files behind ``--input``: the file itself, or a directory's files (preferring ``split``'s)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"--input {path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
    if split:
        matching = [p for p in files if split in p.name]
        files = matching or files
    if not files:
        raise FileNotFoundError(f"--input {path}: no {'/'.join(LOCAL_SUFFIXES)} files")
    return files


def read_local(path: Path, split: Optional[str] = None) -> Iterator[Dict]:
    for file in local_files(path, split):
        if file.suffix not in LOCAL_SUFFIXES:
            raise ValueError(f"{file}: unsupported format (expected {', '.join(LOCAL_SUFFIXES)})")
        yield from (_read_parquet(file) if file.suffix == ".parquet" else _read_json(file))


def read_hub(spec: DatasetSpec, split: str, hub_id: Optional[str] = None, hub_config: Optional[str] = None):
    from datasets import load_dataset

    return load_dataset(hub_id or spec.hub_id, hub_config or spec.hub_config, split=split)


# -- conversion --------------------------------------------------------------------------------------------------


@dataclass
class Report:
    written: int = 0
    skipped: int = 0
    duplicates: int = 0


def make_prompt(question: str) -> str:
    return f"{question.strip()}\n{INSTRUCTION}"


def convert(
    rows: Iterable[Mapping],
    spec: DatasetSpec,
    *,
    datasource: Optional[str] = None,
    question_key: Optional[str] = None,
    label_key: Optional[str] = None,
    limit: Optional[int] = None,
    dedup: bool = True,
    seen: Optional[set] = None,
    report: Optional[Report] = None,
) -> Iterator[Dict[str, str]]:
    """The output records of ``rows`` read as ``spec`` (``question_key`` / ``label_key`` override its fields)."""
    report = report if report is not None else Report()
    seen = seen if seen is not None else set()
    produced = 0
    for row in rows:
        if limit is not None and produced >= limit:
            return
        question = _question(row, (question_key,)) if question_key else spec.question(row)
        label = normalize_label(field(row, label_key)) if label_key else spec.label(row)
        if question is None or label is None:
            report.skipped += 1
            continue
        record = {"prompt": make_prompt(question), "label": label, "datasource": datasource or spec.name}
        key = (record["prompt"], record["label"])
        if dedup and key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        produced += 1
        report.written += 1
        yield record


def _plan(dataset: str, split: Optional[str]) -> List[Tuple[DatasetSpec, str]]:
    names = [name.strip() for name in dataset.split(",") if name.strip()]
    plan: List[Tuple[DatasetSpec, str]] = []
    for name in names:
        if name in SUITES:
            plan.extend((DATASETS[member], member_split) for member, member_split in SUITES[name])
        elif name in DATASETS:
            plan.append((DATASETS[name], split or DATASETS[name].split))
        else:
            known = ", ".join(list(DATASETS) + list(SUITES))
            raise SystemExit(f"--dataset {name!r}: unknown; known: {known}")
    return plan


def _describe() -> str:
    lines = ["datasets (--dataset NAME[,NAME...]):"]
    for spec in DATASETS.values():
        config = f" ({spec.hub_config})" if spec.hub_config else ""
        sources = ", ".join(source.__name__.lstrip("_") for source in spec.labels)
        lines.append(f"  {spec.name:15} {spec.role:5} hub {spec.hub_id}{config} split {spec.split}; label: {sources}")
    for name, members in SUITES.items():
        lines.append(f"  {name:15} suite {', '.join(f'{m} ({s})' for m, s in members)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m d3s_openrlhf.data.prepare",
        description="Convert math datasets to OpenRLHF prompt JSONL ({prompt, label, datasource}).",
        epilog=_describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dataset", help="a name from the list below, a comma-separated list, or eval-suite")
    parser.add_argument("--out", help="output JSONL file (parent directories are created)")
    parser.add_argument("--input", help="local .json/.jsonl/.parquet file or directory (default: the HF hub)")
    parser.add_argument("--split", help="split to read (default: the dataset's; suites use their own)")
    parser.add_argument("--limit", type=int, help="keep at most N rows per dataset")
    parser.add_argument("--hub-id", help="read this hub dataset instead of the default one (one dataset only)")
    parser.add_argument("--hub-config", help="hub configuration name (with --hub-id)")
    parser.add_argument("--question-key", help="field holding the problem (overrides the dataset's)")
    parser.add_argument("--label-key", help="field holding the final answer (overrides the dataset's)")
    parser.add_argument("--datasource", help="value of the datasource field (default: the dataset name)")
    parser.add_argument("--keep-duplicates", action="store_true", help="write repeated (prompt, label) pairs")
    parser.add_argument("--list", action="store_true", help="list the known datasets and exit")
    return parser


def _write_dataset(handle, spec: DatasetSpec, split: str, args: argparse.Namespace, seen: set) -> None:
    rows = (
        read_local(Path(args.input), args.split) if args.input else read_hub(spec, split, args.hub_id, args.hub_config)
    )
    report = Report()
    for record in convert(
        rows,
        spec,
        datasource=args.datasource,
        question_key=args.question_key,
        label_key=args.label_key,
        limit=args.limit,
        dedup=not args.keep_duplicates,
        seen=seen,
        report=report,
    ):
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(
        f"[prepare] {spec.name} ({split}): {report.written} rows, {report.skipped} skipped "
        f"(no problem or no answer), {report.duplicates} duplicates dropped",
        file=sys.stderr,
    )
    if report.written == 0:
        raise SystemExit(f"[prepare] {spec.name}: no usable rows; check --input / --question-key / --label-key")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(_describe())
        return 0
    if not args.dataset or not args.out:
        parser.error("--dataset and --out are required")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    plan = _plan(args.dataset, args.split)
    if len(plan) > 1 and (args.input or args.hub_id or args.datasource):
        parser.error("--input, --hub-id and --datasource take a single dataset")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seen: set = set()
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            for spec, split in plan:
                _write_dataset(handle, spec, split, args, seen)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    print(f"[prepare] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
