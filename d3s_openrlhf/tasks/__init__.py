"""Tasks as plug-ins: a verifiable task is a Python module, named by import path or by file path.

A task module defines

- ``make_examples(split, n, seed) -> list[dict]`` for the splits ``"sft"``, ``"rl"`` and ``"heldout"`` (disjoint,
  deterministic in ``seed``); each dict has ``prompt``, ``answer`` and ``sft_response`` (what the SFT warm start
  imitates; it may be imperfect);
- ``reward(response, answer) -> float``: ``response`` is the generated text up to its first EOS token, possibly
  empty; the reward must be a finite number for any response (:func:`examples` tries it before training).

Everything else is built from it (:mod:`d3s_openrlhf.testbed.pipeline`): a character-level tokenizer over the
characters of the examples (whitespace is normalised away, see :func:`d3s_openrlhf.testbed.toy.build_tokenizer`), the
JSONL files for SFT and RL, and a reward file for ``--reward.remote_url`` (:func:`write_reward_file`) that loads
the task in OpenRLHF's Ray workers. A module given by file path (``/some/dir/my_task.py``) needs nothing on the
workers' path: the reward file loads it from that file.
"""

import hashlib
import importlib
import importlib.util
import math
import os
import sys

SPLITS = ("sft", "rl", "heldout")
DEFAULT_TASK = "d3s_openrlhf.tasks.addition"  # the testbed's (the end-to-end runs'); the demo's: chainsum
EOS = "</s>"


def load_task(spec):
    """The task module named by ``spec``: an import path (``pkg.module``) or the path of a ``.py`` file."""
    if _is_file_spec(spec):
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"task file {path} does not exist; give an import path or a .py file")
        # the path's digest in the name: two task files named alike in two directories are two modules
        digest = hashlib.sha1(path.encode()).hexdigest()[:8]
        name = f"d3s_task_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
        if name not in sys.modules:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            sys.modules[name] = module
        module = sys.modules[name]
    else:
        module = importlib.import_module(spec)
    missing = [name for name in ("make_examples", "reward") if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"task {spec} must define {' and '.join(missing)} (see d3s_openrlhf.tasks)")
    return module


def _is_file_spec(spec):
    return spec.endswith(".py") or os.sep in spec


def _worker_spec(spec):
    """``(import path or None, file path or None)`` by which Ray workers load the task: the import path when there
    is one (package modules with relative imports need it), the file as the fallback (a module the driver found
    through a ``sys.path`` entry the workers lack)."""
    if _is_file_spec(spec):
        return None, os.path.abspath(spec)
    path = getattr(load_task(spec), "__file__", None)
    return spec, (os.path.abspath(path) if path else None)


def examples(task, split, n, seed):
    """``task.make_examples`` with its contract checked: the fields and their types, and ``task.reward`` scoring
    each SFT response and an empty response (the policy can emit EOS at once) as a finite number. A clear
    error here comes before any Ray work instead of a crash mid-training."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    name = task.__name__
    rows = task.make_examples(split, n, seed)
    if len(rows) != n:
        raise ValueError(f"{name}.make_examples({split!r}, {n}, {seed}) returned {len(rows)} examples")
    for row in rows:
        missing = {"prompt", "answer", "sft_response"} - set(row)
        if missing:
            raise ValueError(f"{name}: example {row!r} lacks {sorted(missing)}")
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{name}: prompt {row['prompt']!r} must be a non-empty string")
        if not isinstance(row["sft_response"], str):
            raise ValueError(f"{name}: sft_response {row['sft_response']!r} must be a string")
        for key in ("prompt", "sft_response"):
            if any(ch.isspace() for ch in row[key]):
                raise ValueError(f"{name}: {key} {row[key]!r} contains whitespace, which the tokenizer drops")
        score(task, row["sft_response"], row["answer"])
    if rows:
        score(task, "", rows[0]["answer"])
    return rows


def score(task, response, answer):
    """``float(task.reward(response, answer))``; ``ValueError`` naming the call if it raises or is not finite."""
    call = f"{task.__name__}.reward({response!r}, {answer!r})"
    try:
        value = task.reward(response, answer)
    except Exception as error:
        raise ValueError(f"{call} raised {type(error).__name__}: {error}") from error
    try:
        reward = float(value)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise ValueError(
            f"{call} returned {value!r}; a reward must be a finite number (0.0 for an unscorable response)"
        )
    return reward


def response_of(query, prompt):
    """The response in OpenRLHF's decoded ``query`` (prompt + response, special tokens kept), up to its first EOS."""
    at = query.find(prompt)
    if at < 0:
        raise ValueError(f"prompt {prompt!r} not found in query {query!r}")
    return query[at + len(prompt) :].split(EOS, 1)[0]


REWARD_FILE_TEMPLATE = '''"""Reward file for --reward.remote_url, generated by d3s_openrlhf.tasks.write_reward_file:
task {spec!r}."""

from d3s_openrlhf.tasks import load_task, reward_func_of

try:
    _task = load_task({name!r}) if {name!r} else None
except ModuleNotFoundError:
    _task = None
reward_func = reward_func_of(_task or load_task({file!r}))
'''


def reward_func_of(task):
    """OpenRLHF's ``reward_func(queries, prompts, labels)`` for a task module (one query per call, usually)."""

    def reward_func(queries, prompts, labels, **_):
        import torch

        rewards = torch.tensor([score(task, response_of(q, p), label) for q, p, label in zip(queries, prompts, labels)])
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    return reward_func


def write_reward_file(spec, path):
    """Write the reward file of task ``spec`` to ``path``; returns ``path``."""
    with open(path, "w") as f:
        name, file = _worker_spec(spec)
        f.write(REWARD_FILE_TEMPLATE.format(spec=spec, name=name or "", file=file))
    return path
