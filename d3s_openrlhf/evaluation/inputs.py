"""What ``python -m d3s_openrlhf.cli.evaluate`` checks before any model loads, and the settings of an output directory.

Every refusal is a ``ValueError`` naming the flag (or the file and line) to change.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

from d3s_openrlhf.core.pass_at_k import check_ks

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
DEFAULT_DATASOURCE = "default"  # what OpenRLHF's PromptDataset calls a row without "datasource"
SETTINGS_FILE = "settings.json"
# flags that decide the samples: a rerun into the same --out must repeat them (--k only changes the results)
SAMPLE_FLAGS = (
    "model",
    "data",
    "input_key",
    "label_key",
    "apply_chat_template",
    "n",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "greedy",
    "reward",
)


@dataclass(frozen=True)
class Row:
    """One prompt of the data files, in file order; ``index`` is its position over all files."""

    index: int
    file: str
    line: int  # 1-based
    datasource: str
    data: dict  # the JSON object of the line (the chat template reads the input key from it)
    label: object
    digest: str  # row_digest of the row: the row_digest its sample lines carry

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def row_digest(prompt, label, datasource: str) -> str:
    """The hash of what a row puts into its sample lines (the --input_key value, the label, the datasource): a
    resume checks each stored line against the row now at its index (samples.resume)."""
    return hashlib.sha256(json.dumps([prompt, label, datasource], sort_keys=True).encode()).hexdigest()


def model_key(path: str) -> str:
    """The one form of a --model path for settings.json, the samples file's lines and the duplicate check: ``ckpt``,
    ``ckpt/`` and ``./ckpt`` are one model."""
    return os.path.abspath(path)


def model_digest(path: str) -> str:
    """sha256 of a model directory's files, names and contents in name order (its top level, hidden files aside):
    the weights, config and tokenizer that decide its samples. A resume regenerates the samples of a model whose
    digest changed (samples.resume): a checkpoint saved over in place by a run that went on is not the model its
    samples came from, while the same files written again are. Streamed: constant memory, one read of the files."""
    digest = hashlib.sha256()
    files = sorted((e for e in os.scandir(path) if e.is_file() and not e.name.startswith(".")), key=lambda e: e.name)
    for entry in files:
        digest.update(f"{entry.name}\0{entry.stat().st_size}\0".encode())
        with open(entry.path, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_rows(files: Sequence[str], input_key: str, label_key: str) -> List[Row]:
    """Every row of the JSONL ``files``; refuses a missing or empty file, a bad line, a missing key."""
    rows: List[Row] = []
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"--data {path}: no such file")
        before = len(rows)
        with open(path) as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as error:
                    raise ValueError(f"--data {path} line {number}: not JSON ({error})") from error
                if not isinstance(data, dict):
                    raise ValueError(f"--data {path} line {number}: a JSON object is expected")
                for flag, key in (("--input_key", input_key), ("--label_key", label_key)):
                    if key not in data:
                        raise ValueError(
                            f"--data {path} line {number}: no {key!r} key ({flag} {key}); the line has {sorted(data)}"
                        )
                datasource = str(data.get("datasource", DEFAULT_DATASOURCE))
                digest = row_digest(data[input_key], data[label_key], datasource)
                rows.append(Row(len(rows), path, number, datasource, data, data[label_key], digest))
        if len(rows) == before:
            raise ValueError(f"--data {path}: empty data file (no prompt in it)")
    return rows


def check_model_dir(path: str) -> None:
    """A Hugging Face model directory with weights (``*.safetensors`` or ``*.bin``)."""
    if not os.path.isdir(path):
        raise ValueError(f"--model {path}: not a directory (a Hugging Face model directory is expected)")
    if not any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_PATTERNS):
        raise ValueError(
            f"--model {path}: no weights in the directory (no {' or '.join(WEIGHT_PATTERNS)}); "
            "give the directory a run saved its model to (e.g. --ckpt.output_dir)"
        )


def load_reward_func(path: str):
    """``reward_func`` of the reward file, loaded the way OpenRLHF's rollout actors load ``--reward.remote_url``."""
    if not os.path.isfile(path):
        raise ValueError(f"--reward {path}: no such file")
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        raise ValueError(f"--reward {path}: the file defines no reward_func(queries, prompts, labels)")
    return module.reward_func


def check_arguments(options) -> List[Row]:
    """Every check that needs no model: k <= n, the model directories, the reward file, the data. Returns the rows."""
    if options.n < 1:
        raise ValueError(f"--n {options.n}: at least one sample per prompt")
    try:
        check_ks(options.k, options.n)
    except ValueError as error:
        raise ValueError(f"--k {' '.join(map(str, options.k))} with --n {options.n}: {error}") from error
    if options.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens {options.max_new_tokens}: at least one token")
    if not 0 < options.top_p <= 1:
        raise ValueError(f"--top_p {options.top_p}: must be in (0, 1]")
    if options.temperature < 0:
        raise ValueError(f"--temperature {options.temperature}: must be >= 0")
    keys = [model_key(path) for path in options.model]
    for later, key in enumerate(keys):
        if key in keys[:later]:
            raise ValueError(f"--model: {options.model[later]} is {options.model[keys.index(key)]} again")
    for path in options.model:
        check_model_dir(path)
    if not os.path.isfile(options.reward):
        raise ValueError(f"--reward {options.reward}: no such file")
    return read_rows(options.data, options.input_key, options.label_key)


def sample_settings(options) -> Dict:
    """The flags that decide the samples, paths made absolute."""
    values = {name: getattr(options, name) for name in SAMPLE_FLAGS}
    values["model"] = [model_key(p) for p in options.model]
    values["data"] = [os.path.abspath(p) for p in options.data]
    values["reward"] = os.path.abspath(options.reward)
    return values


def claim_output_dir(out: str, settings: Dict) -> None:
    """Write ``out/settings.json``, or refuse when it holds other settings (naming each differing flag)."""
    path = os.path.join(out, SETTINGS_FILE)
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        differing = [name for name in SAMPLE_FLAGS if previous.get(name) != settings[name]]
        if differing:
            details = "; ".join(f"--{name}: was {previous.get(name)!r}, now {settings[name]!r}" for name in differing)
            raise ValueError(
                f"--out {out} holds an evaluation with other settings ({details}): repeat them to continue it, "
                "or give another --out"
            )
        return
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(settings, f, indent=1)
