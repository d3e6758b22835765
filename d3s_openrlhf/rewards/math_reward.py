"""Rule-based math reward for OpenRLHF's ``--reward.remote_url <path of this file>``, built on math-verify.

How OpenRLHF 0.11.2 uses it: ``SingleTurnAgentExecutor`` (``openrlhf/utils/agent.py``) loads this file with
``importlib.util.spec_from_file_location`` inside every rollout (vLLM engine) actor and calls
``reward_func(queries, prompts, labels)`` through ``asyncio.to_thread``, i.e. from a worker thread, with one
rollout per call. ``queries`` are the decoded prompt + response (special tokens kept), ``prompts`` the prompt
texts, ``labels`` the dataset's ``--data.label_key`` values. It reads ``rewards`` (the training reward),
``scores`` (falls back to ``rewards``; what ``--algo.dynamic_filtering_enable`` thresholds, so it must be in
[0, 1]) and ``extra_logs`` (each value's first element is logged per sample) from the returned dict. The file
is self-contained (standard library, torch, math-verify) so that it also works with plain OpenRLHF.

The reward of one response:

- the answer is the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) of the response,
  nested braces included; no box, an empty box or an unclosed one (a truncated response) = no answer;
- accuracy = 1 if math-verify finds the answer equal to the label (parsed as the gold answer: ``1/2``, ``0.5``
  and ``\\frac{1}{2}`` are equal, so are ``x=3`` and ``3``, intervals, sets, ...), else 0;
- format = 1 if the response has an answer in the sense above, else 0;
- ``rewards = (1 - w) * accuracy + w * format`` with ``w = $D3S_REWARD_FORMAT_WEIGHT`` in [0, 1], default 0
  (pure accuracy: D3S and PODS select on the advantage / reward variance, and a format bonus adds variance
  that is not about correctness; OpenRLHF's eval pass@k also averages ``rewards``, so evaluate with w = 0);
  ``scores`` = accuracy; ``extra_logs`` = ``{"math_accuracy", "math_format"}``.

Model output never raises: anything unparseable, any error inside math-verify, and any timeout gives 0.
A malformed call (lists of different lengths) or an invalid setting does raise.

Timeouts: math-verify bounds ``parse`` / ``verify`` with ``signal.alarm``, which only works in a process's main
thread, and OpenRLHF calls from a worker thread. So off the main thread, answers are judged by a small pool
of child interpreters running this file (``--grader``): each judges in its own main thread with math-verify's
timeouts on, and the caller additionally kills and replaces a child that overruns a hard deadline (a sympy
call stuck in C code ignores the alarm). On the main thread (scripts, tests) math-verify runs in-process.

Settings (environment variables, read at every call; OpenRLHF rollout actors inherit them from the Ray job's
runtime environment):

- ``D3S_REWARD_FORMAT_WEIGHT``: w above, default 0;
- ``D3S_REWARD_TIMEOUT``: seconds math-verify may spend on one parse or one comparison (int >= 1, default 5);
- ``D3S_REWARD_WORKERS``: grader child processes per rollout actor (int >= 1, default 4).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from functools import lru_cache
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as error:  # fail where the file is loaded (OpenRLHF's rollout actor start-up), not per call
    raise ImportError(
        "d3s_openrlhf/rewards/math_reward.py needs math-verify on every node that runs rollouts: "
        "pip install math-verify (or pip install 'd3s-openrlhf[math]')"
    ) from error

logger = logging.getLogger(__name__)

FORMAT_WEIGHT_ENV = "D3S_REWARD_FORMAT_WEIGHT"
TIMEOUT_ENV = "D3S_REWARD_TIMEOUT"
WORKERS_ENV = "D3S_REWARD_WORKERS"

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_ARGUMENT = re.compile(r"[^\s$]+")
_GRADER_FLAG = "--grader"
_GRADER_READY = b"ready\n"
_GRADER_STARTUP_SECONDS = 120.0


# -- answer extraction (pure Python, linear time) ------------------------------------------------------------


def last_boxed_content(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed X`` in ``text``, stripped.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); escaped braces ``\\{`` ``\\}`` do not count.
    Returns None when there is no box, when the last one is empty, or when its braces never close.
    """
    if not isinstance(text, str):
        return None
    last = None
    for last in _BOX_COMMAND.finditer(text):
        pass
    if last is None:
        return None
    start = last.end()
    while start < len(text) and text[start].isspace():
        start += 1
    if start < len(text) and text[start] == "{":
        depth, i = 0, start
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    content = text[start + 1 : i].strip()
                    return content or None
            i += 1
        return None
    if start == last.end():  # "\boxed" directly followed by something other than a brace or a space
        return None
    bare = _BARE_ARGUMENT.match(text, start)
    return bare.group(0) if bare else None


def response_of(query: str, prompt: Optional[str]) -> str:
    """The response part of OpenRLHF's ``query`` (prompt + response): what follows the prompt.

    Falls back to the whole query when the prompt is not found in it (the decoded prompt may differ from the
    prompt text after a left truncation); the last box is then still the response's, since the instruction's
    ``\\boxed{}`` comes first and is empty.
    """
    if prompt:
        at = query.find(prompt)
        if at >= 0:
            return query[at + len(prompt) :]
    return query


def _gold_text(label: str) -> str:
    label = label.strip()
    if len(label) >= 2 and label[0] == "$" and label[-1] == "$":
        label = label.strip("$").strip()
    return label if "\\boxed" in label else "\\boxed{" + label + "}"


# -- judging (math-verify) -----------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _parse_gold(label: str, timeout: int) -> Tuple:
    # G rollouts of a prompt share its label: parse it once per process.
    return tuple(parse(_gold_text(label), extraction_config=_EXTRACTION, parsing_timeout=timeout))


def judge(answer: str, label: str, timeout: int) -> bool:
    """Whether ``answer`` (a box's content) equals ``label`` per math-verify. Main thread only (signal timeouts)."""
    gold = list(_parse_gold(label, timeout))
    if not gold:
        return False
    predicted = parse("\\boxed{" + answer + "}", extraction_config=_EXTRACTION, parsing_timeout=timeout)
    if not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=timeout))


class _GraderProcess:
    """A child interpreter running this file with ``--grader``: JSON lines in, ``{"ok": bool}`` lines out."""

    def __init__(self, timeout: int):
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), _GRADER_FLAG, str(timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buffer = b""
        if self._read_line(time.monotonic() + _GRADER_STARTUP_SECONDS) != _GRADER_READY:
            self.close()
            raise RuntimeError(f"the math-verify grader process ({sys.executable} {__file__}) did not start")

    def judge(self, answer: str, label: str, deadline_seconds: float) -> Optional[bool]:
        """The verdict, or None when the child overran the deadline or died (it is then closed)."""
        request = json.dumps({"answer": answer, "label": label}).encode() + b"\n"
        try:
            self._process.stdin.write(request)
            self._process.stdin.flush()
        except OSError:
            self.close()
            return None
        line = self._read_line(time.monotonic() + deadline_seconds)
        if line is None:
            self.close()
            return None
        return bool(json.loads(line)["ok"])

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            stream.close()

    def _read_line(self, deadline: float) -> Optional[bytes]:
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:  # the child exited
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line + b"\n"


class _GraderPool:
    """Up to ``size`` grader children shared by the calling threads; a child that overruns is replaced."""

    def __init__(self, size: int, timeout: int, deadline_seconds: float):
        self.size, self.timeout, self.deadline_seconds = size, timeout, deadline_seconds
        self._idle: "queue.LifoQueue[_GraderProcess]" = queue.LifoQueue()
        self._lock = threading.Lock()
        self._count = 0
        self._closed = False

    def judge(self, answer: str, label: str) -> Optional[bool]:
        grader = self._checkout()
        try:
            verdict = grader.judge(answer, label, self.deadline_seconds)
        finally:
            self._give_back(grader)
        return verdict

    def close(self) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                grader = self._idle.get_nowait()
            except queue.Empty:
                return
            grader.close()

    def _checkout(self) -> _GraderProcess:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            spawn = self._count < self.size
            if spawn:
                self._count += 1
        if not spawn:
            return self._idle.get()
        try:
            return _GraderProcess(self.timeout)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def _give_back(self, grader: _GraderProcess) -> None:
        with self._lock:
            keep = grader.alive and not self._closed
            if not keep:
                self._count -= 1
        if keep:
            self._idle.put(grader)
        else:
            grader.close()


_pools: Dict[Tuple[int, int], _GraderPool] = {}
_pools_lock = threading.Lock()


def _pool(size: int, timeout: int) -> _GraderPool:
    with _pools_lock:
        pool = _pools.get((size, timeout))
        if pool is None:
            # each of 2 parses and up to 4 comparisons may use the full timeout; slack for the IPC
            pool = _pools[(size, timeout)] = _GraderPool(size, timeout, deadline_seconds=6 * timeout + 10)
        return pool


@atexit.register
def _close_pools() -> None:
    with _pools_lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


# -- settings and the reward function ------------------------------------------------------------------------


class Settings(NamedTuple):
    format_weight: float
    timeout: int
    workers: int


def settings() -> Settings:
    """The reward settings from the environment; ValueError naming the variable on an invalid value."""

    def read(name, default, convert, valid, expected):
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        try:
            value = convert(raw)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise ValueError(f"{name}={raw!r}: expected {expected}")
        return value

    return Settings(
        format_weight=read(FORMAT_WEIGHT_ENV, 0.0, float, lambda w: 0.0 <= w <= 1.0, "a number in [0, 1]"),
        timeout=read(TIMEOUT_ENV, 5, int, lambda t: t >= 1, "an int >= 1 (seconds)"),
        workers=read(WORKERS_ENV, 4, int, lambda n: n >= 1, "an int >= 1"),
    )


settings()  # an invalid setting fails when OpenRLHF loads this file, not silently at every call


def _accuracy(answer: str, label: str, config: Settings) -> float:
    if threading.current_thread() is threading.main_thread():
        return float(judge(answer, label, config.timeout))
    verdict = _pool(config.workers, config.timeout).judge(answer, label)
    if verdict is None:
        logger.warning("math reward: grading overran its deadline; reward 0 for answer %.200r", answer)
    return float(bool(verdict))


def score_response(response: str, label, config: Optional[Settings] = None) -> Tuple[float, float]:
    """(accuracy, format) of one response text against its label; never raises on model output."""
    config = config or settings()
    answer = last_boxed_content(response)
    if answer is None:
        return 0.0, 0.0
    if label is None or not str(label).strip():
        return 0.0, 1.0
    try:
        return _accuracy(answer, str(label), config), 1.0
    except Exception:  # math-verify is defensive already; this guards our own plumbing too
        logger.warning("math reward: grading failed; reward 0", exc_info=True)
        return 0.0, 1.0


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence, **kwargs) -> Dict:
    """OpenRLHF's reward hook: one reward per query (see the module docstring for the exact definition)."""
    import torch  # here, not at the top: the grader children run this file and do not need torch

    if prompts is None:
        prompts = [None] * len(queries)
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(
            f"reward_func: {len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels; "
            "expected one of each per rollout"
        )
    config = settings()
    accuracy: List[float] = []
    formatted: List[float] = []
    for query, prompt, label in zip(queries, prompts, labels):
        text = response_of(query, prompt if isinstance(prompt, str) else None) if isinstance(query, str) else None
        acc, fmt = score_response(text, label, config) if text is not None else (0.0, 0.0)
        accuracy.append(acc)
        formatted.append(fmt)
    accuracy_t = torch.tensor(accuracy, dtype=torch.float32)
    format_t = torch.tensor(formatted, dtype=torch.float32)
    w = config.format_weight
    rewards = accuracy_t if w == 0.0 else (1.0 - w) * accuracy_t + w * format_t
    return {
        "rewards": rewards,
        "scores": accuracy_t,
        "extra_logs": {"math_accuracy": accuracy_t, "math_format": format_t},
    }


# -- the grader child ----------------------------------------------------------------------------------------


def _grader_main(argv: List[str]) -> int:
    timeout = int(argv[0])
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the protocol
    out.write(_GRADER_READY)
    out.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            ok = judge(request["answer"], request["label"], timeout)
        except Exception:
            logger.warning("math reward grader: request failed", exc_info=True)
            ok = False
        out.write(json.dumps({"ok": ok}).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != _GRADER_FLAG:
        sys.exit(f"usage: {sys.argv[0]} {_GRADER_FLAG} TIMEOUT (internal: the grader child of reward_func)")
    sys.exit(_grader_main(sys.argv[2:]))
