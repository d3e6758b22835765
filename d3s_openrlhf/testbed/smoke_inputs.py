"""The toy inputs of the launch-script smoke runs: the SFT warm start of the toy model, its tokenizer with a chat
template, and the task's prompts in the {"prompt", "label"} JSONL the launch scripts read."""

import json
import os
import shutil
from dataclasses import dataclass

from d3s_openrlhf.testbed import pipeline, toy

# A chat template for the character-level toy tokenizer (the scripts pass --data.apply_chat_template): the
# conversation's text as is, so the templated prompt is the toy prompt "12+7=" the SFT model was trained on.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ToyFiles:
    model: str  # the SFT warm start, its tokenizer with CHAT_TEMPLATE
    train: str  # {"prompt", "label"} JSONL, the keys the scripts read
    eval: str


def prepare_toy(workdir, prepared=None, on_line=None):
    """Toy model and data in ``workdir`` (reused when already there); ``prepared``: an SFT run to start from."""
    from transformers import AutoTokenizer

    done = os.path.join(workdir, "smoke_inputs.json")
    if os.path.exists(done):
        with open(done) as f:
            return ToyFiles(**json.load(f))
    prepared = prepared or pipeline.prepare(os.path.join(workdir, "toy"), on_line=on_line)
    model = os.path.join(workdir, "model")
    shutil.copytree(prepared.sft_model, model, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)

    def convert(source, target, limit=None):
        with open(source) as f:
            rows = [json.loads(line) for line in f][:limit]
        return toy.write_jsonl(target, [{"prompt": row["input"], "label": row["label"]} for row in rows])

    files = ToyFiles(
        model=model,
        train=convert(prepared.task.prompts, os.path.join(workdir, "train.jsonl")),
        eval=convert(prepared.task.heldout, os.path.join(workdir, "eval.jsonl"), limit=8),
    )
    with open(done, "w") as f:
        json.dump(files.__dict__, f)
    return files
