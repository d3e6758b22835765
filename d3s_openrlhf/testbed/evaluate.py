"""Held-out evaluation of a checkpoint under a task's reward, with transformers' ``generate`` (no Ray, no vLLM), and
the intervals the demo prints with it."""

import json
import math

import numpy as np

from d3s_openrlhf import tasks
from d3s_openrlhf.core.pass_at_k import is_correct, pass_at_k

Z_95 = 1.959964  # the standard normal's 97.5% quantile: a two-sided 95% interval


def heldout_accuracy(model_path, heldout_path, samples=8, seed=0, task=tasks.DEFAULT_TASK, max_new_tokens=4):
    """Held-out accuracy under ``task``'s reward, the means over prompts of :func:`heldout_scores`: ``greedy``;
    ``sampled`` and ``pass@<samples>``; ``entropy``. ``samples=0``: ``greedy`` alone."""
    scores = heldout_scores(model_path, heldout_path, samples, seed, task, max_new_tokens)
    return {key: value if key == "entropy" else float(np.mean(value)) for key, value in scores.items()}


def interval(values, z=Z_95):
    """``(mean, half-width)`` of the normal-approximation interval of the mean of per-prompt ``values`` (P,):
    ``z`` standard errors, the sample standard deviation over sqrt(P) (half-width 0 for one prompt)."""
    values = np.asarray(values, dtype=np.float64)
    half = z * values.std(ddof=1) / math.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(half)


def heldout_scores(model_path, heldout_path, samples=8, seed=0, task=tasks.DEFAULT_TASK, max_new_tokens=4):
    """Per-prompt held-out scores under ``task``'s reward, each (P,) in the held-out file's order: ``greedy``
    (1.0 right, 0.0 wrong); ``sampled``, the unbiased pass@1 of ``samples`` responses per prompt at temperature 1
    (as in training), and ``pass@<samples>``, both from :mod:`d3s_openrlhf.core.pass_at_k` (the estimator and
    correctness rule of ``d3s_openrlhf.cli.evaluate``); with ``entropy``, the mean per-token entropy (nats) of the
    policy over the sampled response tokens (one number). ``samples=0``: ``greedy`` alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = tasks.load_task(task)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with open(heldout_path) as f:
        rows = [json.loads(line) for line in f]
    prompts = [row["input"] for row in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = batch["input_ids"].shape[1]

    def evaluate(do_sample, repeats):
        torch.manual_seed(seed)
        inputs = {key: value.repeat(repeats, 1) for key, value in batch.items()}
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=1.0 if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        responses = output.sequences[:, width:]
        texts = tokenizer.batch_decode(responses, skip_special_tokens=False)
        labels = [row["label"] for row in rows] * repeats
        rewards = [tasks.score(module, tasks.response_of(text, ""), label) for text, label in zip(texts, labels)]
        correct = is_correct(rewards).reshape(repeats, len(rows)).sum(axis=0)  # (P,): sample r of prompt p at r*P + p
        # (R, T) entropy of each generated position; positions after the EOS token are padding
        log_probs = torch.stack(output.logits, dim=1).float().log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        is_eos = responses == tokenizer.eos_token_id
        generated = (is_eos.long().cumsum(-1) - is_eos.long()) == 0
        return correct, float((entropy * generated).sum() / generated.sum())

    greedy, _ = evaluate(False, 1)
    if not samples:
        return {"greedy": pass_at_k(1, greedy, 1)}
    sampled, entropy = evaluate(True, samples)
    return {
        "greedy": pass_at_k(1, greedy, 1),
        "sampled": pass_at_k(samples, sampled, 1),
        f"pass@{samples}": pass_at_k(samples, sampled, samples),
        "entropy": entropy,
    }
