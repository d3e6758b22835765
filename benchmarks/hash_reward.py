"""A reward for timing runs (``--reward.remote_url``): a fixed pseudo-random 0/1 per response (CRC32 parity).

Random-model responses are never right on a real task; this gives about half of them reward 1, so groups have
reward variance and every selection rule does its real work.
"""

import zlib

import torch


def reward_func(queries, prompts, labels):
    rewards = torch.tensor([float(zlib.crc32(query.encode()) % 2) for query in queries])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
