"""Run an OpenRLHF (or d3s-openrlhf) module on a machine without a GPU.

    python -m d3s_openrlhf.cli.cpu [--address ADDR] [--num-gpus 8] <module> [module args...]

e.g. ``python -m d3s_openrlhf.cli.cpu openrlhf.cli.train_ppo_ray --vllm.sync_backend gloo ...`` or
``... openrlhf.cli.train_sft ...``. Starts a local Ray head on 127.0.0.1 with fake GPU resources (unless an
address is given: ``--address`` or ``RAY_ADDRESS``), applies the CPU adjustments here and in every Ray
worker (see :mod:`d3s_openrlhf.cpu`), runs the module as ``__main__`` and stops the head on any exit,
errors and Ctrl-C included.

For ``openrlhf.cli.train_ppo_ray`` and ``d3s_openrlhf.cli.train_ppo_ray`` the flags first go through the CPU
pre-flight (:mod:`d3s_openrlhf.cpu.preflight`), before the head starts: flags the runtime cannot run are
refused by name, or changed to their CPU equivalent with a note on stderr.

``--fp32`` (or ``D3S_OPENRLHF_CPU_FP32=1``): every model trains, scores and generates in float32 instead of
``--ds.param_dtype`` (upstream offers bf16 and fp16 only). On CPUs without native bf16 arithmetic, bf16 is
emulated and runs about 13x slower than fp32; the flag changes the precision, not the algorithm.
"""

import argparse
import os
import runpy
import sys

# module -> whether its command line may hold --d3s.* flags
PREFLIGHT_MODULES = {"openrlhf.cli.train_ppo_ray": False, "d3s_openrlhf.cli.train_ppo_ray": True}
NO_RUN_FLAGS = ("-h", "--help", "--d3s.dry_run")  # the module only prints: nothing to check


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m d3s_openrlhf.cli.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="existing Ray cluster (default: RAY_ADDRESS, else a new head)")
    parser.add_argument("--num-gpus", type=int, default=8, help="fake GPU resources of a new head (default 8)")
    parser.add_argument(
        "--fp32",
        action="store_true",
        help="train, score and generate in float32 whatever --ds.param_dtype says (sets D3S_OPENRLHF_CPU_FP32=1 for "
        "every process of the job): CPUs without native bf16 run bf16 about 13x slower",
    )
    parser.add_argument("module", help="module to run as __main__, e.g. openrlhf.cli.train_ppo_ray")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module")
    return parser.parse_args(argv)


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    from d3s_openrlhf.cpu import precision, preflight, runtime

    if options.fp32:
        os.environ[precision.FP32_ENV] = "1"
    try:
        fp32 = precision.fp32_requested()
    except ValueError as exc:
        print(f"python -m d3s_openrlhf.cli.cpu: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    args = options.args
    # a head given by address is the user's: its GPUs are not checked
    head_gpus = None if (options.address or os.environ.get("RAY_ADDRESS")) else options.num_gpus
    if options.module in PREFLIGHT_MODULES and not any(flag in args for flag in NO_RUN_FLAGS):
        try:
            args = preflight.prepare(args, d3s_flags=PREFLIGHT_MODULES[options.module], num_gpus=head_gpus)
        except ValueError as exc:
            print(f"python -m d3s_openrlhf.cli.cpu: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
    if fp32:
        print(f"{preflight.PREFIX} float32 for every model ({precision.FP32_ENV}=1)", file=sys.stderr)
    runtime.activate(address=options.address, num_gpus=options.num_gpus)
    sys.argv = [options.module, *args]
    try:
        runpy.run_module(options.module, run_name="__main__", alter_sys=True)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
