"""Tasks as plug-ins (d3s_openrlhf.tasks): loading by import path and by file, the contract checks, the task files
and tokenizer built from a module, and the generated reward file as OpenRLHF's workers load it."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from d3s_openrlhf import tasks
from d3s_openrlhf.tasks import addition
from d3s_openrlhf.testbed import pipeline, toy

REVERSE_TASK = """
import random

def make_examples(split, n, seed):
    offset = {"sft": 0, "rl": 1, "heldout": 2}[split]
    words = ["".join(w) for w in __import__("itertools").product("abcd", repeat=3)]
    random.Random(seed).shuffle(words)
    chosen = words[offset::3][:n]
    return [{"prompt": w + ">", "answer": w[::-1], "sft_response": w[::-1]} for w in chosen]

def reward(response, answer):
    return float(response == answer)
"""


def write_module(directory, name="reverse_task", source=REVERSE_TASK):
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_load_by_import_path_and_by_file(tmp_path):
    assert tasks.load_task("d3s_openrlhf.tasks.addition") is addition
    module = tasks.load_task(str(write_module(tmp_path)))
    assert module.reward("cba", "cba") == 1.0 and module.reward("cb", "cba") == 0.0


def test_files_of_the_same_name_in_two_directories_are_two_tasks(tmp_path):
    for directory in ("a", "b"):
        (tmp_path / directory).mkdir()
    first = tasks.load_task(str(write_module(tmp_path / "a", "task")))
    second = tasks.load_task(
        str(write_module(tmp_path / "b", "task", REVERSE_TASK.replace("response == answer", "True")))
    )
    assert first.reward("x", "y") == 0.0 and second.reward("x", "y") == 1.0
    assert tasks.load_task(str(tmp_path / "a" / "task.py")) is first


def test_bad_modules_are_named(tmp_path):
    with pytest.raises(TypeError, match="must define reward"):
        tasks.load_task(str(write_module(tmp_path, "no_reward", "def make_examples(split, n, seed):\n    return []\n")))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tasks.load_task(str(tmp_path / "missing.py"))
    short = write_module(tmp_path, "short", REVERSE_TASK.replace("[:n]", "[: n - 1]"))
    with pytest.raises(ValueError, match="returned 3 examples"):
        tasks.examples(tasks.load_task(str(short)), "sft", 4, 0)
    spaced = write_module(tmp_path, "spaced", REVERSE_TASK.replace('w + ">"', 'w + " >"'))
    with pytest.raises(ValueError, match="whitespace"):
        tasks.examples(tasks.load_task(str(spaced)), "sft", 4, 0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (('w + ">"', "len(w)"), r"prompt 3 must be a non-empty string"),
        (('w + ">"', '""'), r"prompt '' must be a non-empty string"),
        (('"sft_response": w[::-1]', '"sft_response": None'), r"sft_response None must be a string"),
        (("return float(response == answer)", "return None"), r"reward\('([a-d]{3})', '\1'\) returned None"),
        (("return float(response == answer)", "return float('nan')"), r"reward\('([a-d]{3})', '\1'\) returned nan"),
        (("return float(response == answer)", "return 'yes'"), r"reward\('([a-d]{3})', '\1'\) returned 'yes'"),
        # the policy can end its response at once: a reward that fails on "" would stop the run mid-training
        (
            ("return float(response == answer)", "return float(response[-1] == answer[-1])"),
            r"reward\('', '[a-d]{3}'\) raised IndexError",
        ),
    ],
)
def test_bad_examples_and_rewards_are_refused_before_training(tmp_path, edit, message):
    bad = write_module(tmp_path, "bad", REVERSE_TASK.replace(*edit))
    with pytest.raises(ValueError, match=message) as error:
        tasks.examples(tasks.load_task(str(bad)), "sft", 4, 0)
    assert "bad" in str(error.value)  # names the task module


def test_task_config_keys_are_checked(tmp_path):
    good = write_module(tmp_path, "sized", REVERSE_TASK + "TASK_CONFIG = {'n_sft': 12, 'sft_epochs': 2}\n")
    assert pipeline.task_config(str(good), sft_epochs=3) == pipeline.TaskConfig(task=str(good), n_sft=12, sft_epochs=3)
    typo = write_module(tmp_path, "typo", REVERSE_TASK + "TASK_CONFIG = {'n_sfts': 12}\n")
    with pytest.raises(ValueError, match=r"TASK_CONFIG keys \['n_sfts'\] are not among .*'n_sft'"):
        pipeline.task_config(str(typo))


def test_sft_and_rl_may_share_prompts_a_leaked_held_out_prompt_is_dropped(tmp_path, capsys):
    # every split draws from the same seeded words: SFT and RL share them (allowed), and so does held-out (leakage)
    same = write_module(tmp_path, "same", REVERSE_TASK.replace('{"sft": 0, "rl": 1, "heldout": 2}[split]', "0"))
    config = pipeline.TaskConfig(task=str(same), n_sft=4, n_prompts=4, n_heldout=6)
    files, *_ = pipeline.write_task_files(str(tmp_path / "data"), config)
    prompts = {name: [json.loads(line)["input"] for line in open(path)] for name, path in files.__dict__.items()}
    assert prompts["sft"] == prompts["prompts"]
    assert len(prompts["heldout"]) == 2 and not set(prompts["heldout"]) & set(prompts["sft"])
    assert "dropped 4 of 6 held-out prompts that also appear in the sft or rl split" in capsys.readouterr().err
    with pytest.raises(ValueError, match="every held-out prompt"):
        pipeline.write_task_files(str(tmp_path / "all"), dataclasses.replace(config, n_heldout=4))


# sha256 of the files the addition task wrote before it was a plug-in (operands 0..29, 420 / 400 / 80 problems):
# the demo's and the benchmarks' recorded results were trained on exactly these.
HISTORICAL_ADDITION_FILES = {
    "sft": "903586cf789741741cba81d3112b5481e25462b13a4bdabc907cc1ac6781991e",
    "prompts": "991a2f6a3086366984ef4dca7f248212aba279dbbebf624a7cc80fb3e8ce897f",
    "heldout": "6bddfa60a6e74bd4cf08a5af5b80eb953dfa18daa5226e5469b5a829a2032ee4",
}


def test_addition_module_reproduces_the_historical_task_files(tmp_path):
    files, characters, max_new_tokens, max_len = pipeline.write_task_files(str(tmp_path / "new"), pipeline.TaskConfig())
    digests = {name: hashlib.sha256(open(path, "rb").read()).hexdigest() for name, path in files.__dict__.items()}
    assert digests == HISTORICAL_ADDITION_FILES
    assert tuple(characters) == addition.CHARACTERS and max_new_tokens == 4


def test_task_files_and_tokenizer_from_a_module(tmp_path):
    module = write_module(tmp_path)
    config = pipeline.TaskConfig(task=str(module), n_sft=8, n_prompts=6, n_heldout=4)
    files, characters, max_new_tokens, max_len = pipeline.write_task_files(str(tmp_path / "data"), config)
    assert characters == [">", "a", "b", "c", "d"]
    assert max_new_tokens == 4 and max_len == 4 + 1 + 4  # longest SFT response + EOS; prompt + BOS + response
    rows = {name: [json.loads(line) for line in open(path)] for name, path in files.__dict__.items()}
    assert [len(rows[k]) for k in ("sft", "prompts", "heldout")] == [8, 6, 4]
    assert all(row["output"] == row["input"][:3][::-1] for row in rows["sft"])
    tokenizer = toy.build_tokenizer(characters=characters)
    ids = tokenizer(rows["sft"][0]["input"] + rows["sft"][0]["output"], add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tokenizer.unk_token_id not in ids


@pytest.mark.parametrize("by", ["file", "import path on the driver's sys.path only"])
def test_reward_file_loads_in_a_fresh_interpreter(tmp_path, by, monkeypatch):
    """The reward file works where Ray workers run it: a new process, without the driver's sys.path additions."""
    (tmp_path / "elsewhere").mkdir()
    module = write_module(tmp_path / "elsewhere" if by == "file" else tmp_path, "worker_task")
    if by == "file":
        spec = str(module)
    else:
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = "worker_task"
    reward_file = tasks.write_reward_file(spec, str(tmp_path / "reward.py"))
    probe = textwrap.dedent(
        f"""
        import importlib.util, json
        s = importlib.util.spec_from_file_location("reward_func", {reward_file!r})
        m = importlib.util.module_from_spec(s); s.loader.exec_module(m)
        out = m.reward_func(["<s>abc>cba</s><pad>", "abc>cb</s>", "<s>abd>dba"], ["abc>", "abc>", "abd>"],
                            ["cba", "cba", "dba"])
        print(json.dumps(out["rewards"].tolist()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(tasks.__file__))))
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=str(tmp_path.parent), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [1.0, 0.0, 1.0]


def test_response_of_cuts_at_eos_and_names_a_missing_prompt():
    assert tasks.response_of("<s>1+2=3</s><pad>", "1+2=") == "3"
    assert tasks.response_of("12", "") == "12"
    with pytest.raises(ValueError, match="not found"):
        tasks.response_of("<s>1+2=3", "2+2=")
