"""Run an OpenRLHF (or d3s-openrlhf) module on a machine without a GPU.

    python -m d3s_openrlhf.cli.cpu [--address ADDR] [--num-gpus 8] <module> [module args...]

e.g. ``python -m d3s_openrlhf.cli.cpu openrlhf.cli.train_ppo_ray --vllm.sync_backend gloo ...`` or
``... openrlhf.cli.train_sft ...``. Starts a local Ray head on 127.0.0.1 with fake GPU resources (unless an
address is given: ``--address`` or ``RAY_ADDRESS``), applies the CPU adjustments here and in every Ray
worker (see :mod:`d3s_openrlhf.cpu`), runs the module as ``__main__`` and stops the head on any exit,
errors and Ctrl-C included.
"""

import argparse
import runpy
import sys


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m d3s_openrlhf.cli.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="existing Ray cluster (default: RAY_ADDRESS, else a new head)")
    parser.add_argument("--num-gpus", type=int, default=8, help="fake GPU resources of a new head (default 8)")
    parser.add_argument("module", help="module to run as __main__, e.g. openrlhf.cli.train_ppo_ray")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module")
    return parser.parse_args(argv)


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    from d3s_openrlhf.cpu import runtime

    runtime.activate(address=options.address, num_gpus=options.num_gpus)
    sys.argv = [options.module, *options.args]
    try:
        runpy.run_module(options.module, run_name="__main__", alter_sys=True)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
