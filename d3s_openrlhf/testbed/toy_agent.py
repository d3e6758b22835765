"""A two-turn agent for the toy addition task, for ``--train.agent_func_path <path of this file>``.

OpenRLHF's vLLM rollout actors load the file and run ``AgentExecutor`` (its ``MultiTurnAgentExecutor``) on each
prompt. Turn 1: the model answers the question; the environment gives no reward and asks the question again.
Turn 2: the model answers again; the episode ends with its only reward, the share of the two answers (each up to its
first EOS) that are the label: 0, 0.5 or 1. Both answers are action tokens of the rollout; the repeated question is
not. Counting the first answer too keeps the reward of most prompts varied: the toy model rarely answers right after
the repeated question, and a reward of the second answer alone was flat for all but a few prompts.
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 2
EOS = "</s>"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.correct = 0
        self.question = ""

    async def reset(self, states: dict, **kwargs):
        self.question = states["observation"]
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        done = self.turn >= TURNS
        answer = states["action_text"].split(EOS, 1)[0].strip()
        self.correct += answer == str(states["label"]).strip()
        reward = self.correct / TURNS if done else 0.0
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
