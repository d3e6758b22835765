"""Exact-match reward for the toy addition task, for ``--reward.remote_url <path of this file>``.

OpenRLHF loads the file with ``importlib`` and calls ``reward_func(queries, prompts, labels)`` from its rollout
actors (one query per call); ``queries`` are the decoded prompt+response texts, special tokens kept. The
reward is 1.0 when the response, up to its first EOS token, is exactly the label, else 0.0.
"""

import torch

EOS = "</s>"


def answer_of(query, prompt):
    response = query[len(prompt) :] if query.startswith(prompt) else query.rsplit("=", 1)[-1]
    return response.split(EOS, 1)[0]


def reward_func(queries, prompts, labels):
    rewards = torch.tensor(
        [float(answer_of(q, p) == str(label).strip()) for q, p, label in zip(queries, prompts, labels)]
    )
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
