"""Evaluate checkpoints: unbiased pass@k per benchmark, the papers' table.

    python -m d3s_openrlhf.cli.evaluate --model RUN_A/final_model RUN_B/final_model --data data/eval_math.jsonl \
        --input_key prompt --label_key label --apply_chat_template --n 32 --k 1 8 --out eval_out

Writes ``--out``/samples.jsonl (one line per sample, as prompts complete), results.json (pass@k per benchmark and
their average, per model) and results.md (one row per model, benchmarks as columns). Rerunning the same command
continues where it stopped; other settings into the same --out are refused, and so is data whose rows are not the
ones its samples answer; a model whose files changed (a checkpoint saved over in place) is generated again. A
sample is correct iff its reward is >= 1 - 1e-6 (reward 1 correct, 0 wrong, partial credit wrong); a reward that
raises or is not finite stops the run naming the prompt. See docs/reproducing.md,
"Evaluate checkpoints: the papers' table".
"""

import argparse
import os
import sys

import d3s_openrlhf.rewards

DEFAULT_REWARD = os.path.join(os.path.dirname(os.path.abspath(d3s_openrlhf.rewards.__file__)), "math_reward.py")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m d3s_openrlhf.cli.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        nargs="+",
        required=True,
        help="Hugging Face model directories (e.g. a run's --ckpt.output_dir); several give one row each",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="JSONL files as d3s_openrlhf.data.prepare writes them ({prompt, label, datasource}); "
        "a benchmark per datasource",
    )
    parser.add_argument("--input_key", default="prompt", help="the prompt's key (default prompt)")
    parser.add_argument("--label_key", default="label", help="the label's key (default label)")
    parser.add_argument(
        "--apply_chat_template",
        action="store_true",
        help="wrap the prompt in the tokenizer's chat template, as OpenRLHF's --data.apply_chat_template",
    )
    parser.add_argument("--n", type=int, default=32, help="samples per prompt (default 32)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8], help="the k of pass@k, each <= n (default 1 8)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="sampling temperature (default 0.6, OpenRLHF's --eval.temperature)",
    )
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=3072, help="response budget (default 3072)")
    parser.add_argument(
        "--seed", type=int, default=42, help="sample j of prompt i is drawn with seed + i * n + j (default 42)"
    )
    parser.add_argument("--greedy", action="store_true", help="one more greedy sample per prompt (reported apart)")
    parser.add_argument(
        "--reward",
        default=DEFAULT_REWARD,
        help="reward file, as training's --reward.remote_url (default: d3s_openrlhf/rewards/math_reward.py)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num_engines", type=int, default=1, help="vLLM engines (data parallel, default 1)")
    parser.add_argument(
        "--tensor_parallel_size",
        type=int,
        default=1,
        help="GPUs per engine (default 1; a node's GPU count shards the model over the node)",
    )
    parser.add_argument("--enforce_eager", action="store_true", help="no CUDA graphs (always on CPU)")
    options = parser.parse_args(argv)
    for flag in ("num_engines", "tensor_parallel_size"):
        if getattr(options, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    return options


def main(argv=None):
    from d3s_openrlhf.evaluation import inputs, samples

    options = parse(sys.argv[1:] if argv is None else argv)
    try:
        rows = inputs.check_arguments(options)
        reward_func = inputs.load_reward_func(options.reward)
        inputs.claim_output_dir(options.out, inputs.sample_settings(options))
        digests = {inputs.model_key(model): inputs.model_digest(model) for model in options.model}
        complete, stale = samples.resume(options.out, options.n + int(options.greedy), rows, digests)
    except ValueError as error:
        print(f"python -m d3s_openrlhf.cli.evaluate: error: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    for model, prompts in stale.items():
        print(
            f"python -m d3s_openrlhf.cli.evaluate: --model {model}: its files changed since {prompts} prompts were "
            f"generated into {options.out} (a checkpoint saved over in place?); generating them again",
            file=sys.stderr,
        )

    from d3s_openrlhf.evaluation.generate import EvaluationError
    from d3s_openrlhf.evaluation.runner import evaluate

    try:
        evaluate(options, rows, reward_func, complete, digests)
    except EvaluationError as error:
        print(
            f"python -m d3s_openrlhf.cli.evaluate: stopped: {error} (samples so far kept in {options.out})",
            file=sys.stderr,
        )
        raise SystemExit(1) from error
    with open(os.path.join(options.out, "results.md")) as f:
        print(f.read(), end="")


if __name__ == "__main__":
    main()
