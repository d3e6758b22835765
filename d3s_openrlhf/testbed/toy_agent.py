"""A two-turn agent for the toy addition task, for ``--train.agent_func_path <path of this file>``.

OpenRLHF's vLLM rollout actors load the file and run ``AgentExecutor`` (its ``MultiTurnAgentExecutor``) on each
prompt. Turn 1: the model answers the question; the environment gives no reward and asks the question again.
Turn 2: the model answers again; the episode ends with reward 1.0 if that answer (up to its first EOS) is the
label, else 0.0. Both answers are action tokens of the rollout; the repeated question is not.
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 2
EOS = "</s>"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.question = ""

    async def reset(self, states: dict, **kwargs):
        self.question = states["observation"]
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        done = self.turn >= TURNS
        answer = states["action_text"].split(EOS, 1)[0].strip()
        reward = float(done and answer == str(states["label"]).strip())
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "" if done else self.question,
            "done": done,
            "sampling_params": states["sampling_params"],
            "extra_logs": {"agent_turns": torch.tensor(float(self.turn))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
