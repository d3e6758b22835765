"""``python -m d3s_openrlhf.cli.smoke_script <script.sh ...> | --all``: CPU smoke runs of the launch scripts (see
:mod:`d3s_openrlhf.testbed.smoke`)."""

import argparse
import os
import signal
import sys
import tempfile

from d3s_openrlhf.testbed import smoke
from d3s_openrlhf.testbed.smoke_inputs import prepare_toy


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m d3s_openrlhf.cli.smoke_script",
        description="Run examples/scripts/<model>/<setting>.sh for two steps on the CPU runtime with the toy model.",
    )
    parser.add_argument("scripts", nargs="*", help="launch scripts to run")
    parser.add_argument("--all", action="store_true", help="every script under --scripts-dir")
    parser.add_argument(
        "--scripts-dir",
        default=smoke.SCRIPTS_DIR,
        help=f"the launch scripts of a d3s-openrlhf checkout, for --all (default: {smoke.SCRIPTS_DIR} in the "
        "current directory)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="Ray nodes started on this machine (NNODES)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="fake GPUs per node (GPUS_PER_NODE)")
    parser.add_argument("--workdir", default=None, help="toy model, data and runs (default: a new temp dir)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per script run")
    parser.add_argument("-q", "--quiet", action="store_true", help="no run output, only the summary")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags appended to every script")
    options = parser.parse_args(argv)
    if options.extra[:1] == ["--"]:
        options.extra = options.extra[1:]
    if options.all:
        options.scripts = smoke.all_scripts(options.scripts_dir)
        if not options.scripts:
            parser.error(
                f"no launch scripts under {os.path.abspath(options.scripts_dir)}: run from a d3s-openrlhf checkout "
                "or give its examples/scripts as --scripts-dir"
            )
    if not options.scripts:
        parser.error("name at least one script, or --all")
    for script in options.scripts:
        if not os.path.isfile(script):
            parser.error(f"no such script: {script}")
    return options


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    # a plain `kill` / `timeout` must stop the runs and the cluster too, as Ctrl-C does
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = os.path.abspath(options.workdir or tempfile.mkdtemp(prefix="d3s-smoke-"))
    on_line = None if options.quiet else lambda line: print(line, end="", flush=True)
    toy_files = prepare_toy(workdir, on_line=on_line)
    results = []
    for script in options.scripts:
        result = smoke.run_script(
            os.path.abspath(script),
            toy_files,
            os.path.join(workdir, "runs"),
            nodes=options.nodes,
            gpus_per_node=options.gpus_per_node,
            timeout=options.timeout,
            on_line=on_line,
            extra=options.extra,
        )
        print(result.summary(), flush=True)
        results.append(result)
    print("\nsummary:")
    for result in results:
        print("  " + result.summary())
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
