"""CPU smoke run of a launch script: ``examples/scripts/<model>/<setting>.sh`` for two steps on this machine.

    python -m d3s_openrlhf.cli.smoke_script examples/scripts/qwen2.5-math-1.5b/grpo_d3s.sh [--nodes 2]
    python -m d3s_openrlhf.cli.smoke_script --all

The script runs as written (its own ``ray job submit``, runtime env and working_dir upload of the checkout), with
only the toy model, data and sizes swapped in through the environment variables common.sh reads
(:data:`SWAPPED`), plus ``--data.max_samples`` so that the run is exactly :data:`STEPS` steps. Every other
flag -- colocation, ZeRO stage, loss, ``--d3s.*`` -- is the script's. The job runs under the CPU runtime
(:mod:`d3s_openrlhf.cpu.runtime`): the script's runtime env gets ``D3S_OPENRLHF_CPU=1`` (through common.sh's
``D3S_RUNTIME_ENV_VARS``), so the job's driver activates the runtime against the cluster and gives its workers
the CUDA -> CPU adjustments; ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1`` lets the driver's runtime env add to the job's
(Ray refuses to merge the two otherwise).

The Ray cluster is started here: a head (``ray start --head``) and ``nodes - 1`` more nodes on this machine,
every one bound to 127.0.0.1 with its own ports and fake GPUs, the dashboard (job server) on
127.0.0.1 too. Every process of the cluster carries a marker in its environment and is stopped by PID when the
run ends, fails or times out (``ray stop`` would stop other users' clusters on the machine too).
"""

import argparse
import glob
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from d3s_openrlhf.testbed import pipeline, toy
from d3s_openrlhf.testbed.metrics import read_train_scalars

SCRIPTS_DIR = os.path.join("examples", "scripts")  # under the checkout the command runs in
MARKER = "D3S_SMOKE_CLUSTER"
STEPS = 2
# A chat template for the character-level toy tokenizer (the scripts pass --data.apply_chat_template): the
# conversation's text as is, so the templated prompt is the toy prompt "12+7=" the SFT model was trained on.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{% endfor %}"
)

# Toy sizes, the same for any --nodes and --gpus-per-node. G = 32 keeps the scripts' D3S schedule (N 8 -> 32)
# legal; 2 prompts x 32 rollouts = 64 a step, split into kept counts that are multiples of lcm(TRAIN_BATCH 16,
# ROLLOUT_MICRO_BATCH 8 x forward ranks) (integration.host.kept_count_unit): 16 up to 2 ranks, 64 at 8.
PROMPTS_PER_STEP = 2


def swapped_env(toy_files, ckpt_root, nodes, gpus_per_node):
    """The common.sh variables this tool sets (everything else comes from the script)."""
    return {
        "MODEL": toy_files.model,
        "DATA": toy_files.train,
        "EVAL_DATA": toy_files.eval,
        "REWARD_FUNC": pipeline.REWARD_FILE,
        "CKPT_ROOT": ckpt_root,
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(gpus_per_node),
        "N_SAMPLES": "32",
        "ROLLOUT_BATCH": str(PROMPTS_PER_STEP),
        "TRAIN_BATCH": "16",
        "TRAIN_MICRO_BATCH": "8",
        "ROLLOUT_MICRO_BATCH": "8",
        "NUM_EPISODES": "1",
        "MAX_LEN": "16",
        "MAX_NEW_TOKENS": "4",
        "EVAL_STEPS": str(STEPS),  # evaluation and a checkpoint once, at the last step
        "SAVE_STEPS": str(STEPS),
    }


def extra_args():
    """Flags appended to the script's command line (its last occurrence wins)."""
    return ["--data.max_samples", str(PROMPTS_PER_STEP * STEPS)]



# ------------------------------------------------------------------------------------------------ toy inputs
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


# ------------------------------------------------------------------------------------------------ the cluster
def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _marked(cluster_id):
    needle = f"{MARKER}={cluster_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def ray_environment(cluster_id, checkout):
    """The environment of the Ray processes: this Python's ``bin`` first on PATH (the job's ``python3``), the
    ``checkout`` off PYTHONPATH (the job must import the plugin from its uploaded working_dir), the marker."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != checkout]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    for key in ("RAY_ADDRESS", "D3S_OPENRLHF_CPU"):
        env.pop(key, None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray's single-machine mode: every node address is 127.0.0.1 and Ray's servers listen on it only (with the
    # multi-node mode, Ray replaces a given 127.0.0.1 by the machine's routable address)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # the dashboard's modules get 30 s to start by default, too short on a busy laptop
    env.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "180")
    env[MARKER] = cluster_id
    return env


# `ray start`, except that a node may join a cluster in single-machine mode (which the CLI refuses with "not
# supported on Windows and OSX"): a joining node's address stays 127.0.0.1, as its processes' is.
_RAY_START = """
import sys
from ray._private import ray_constants, services
from ray.scripts.scripts import main
if "--head" not in sys.argv:
    ray_constants.ENABLE_RAY_CLUSTER = True
    services.resolve_ip_for_localhost = lambda host: host
sys.argv = ["ray", "start", *sys.argv[1:]]
main()
"""


@dataclass
class Cluster:
    """A Ray cluster of ``nodes`` nodes on 127.0.0.1, each with ``gpus_per_node`` fake GPUs."""

    nodes: int = 1
    gpus_per_node: int = 1
    cpus_per_node: int = 16  # logical: placement groups and actors reserve CPUs, the cores are shared anyway
    object_store_gb: float = 0.5
    log: object = None  # a text file the `ray start` output goes to
    checkout: str = ""  # the checkout the jobs ship as their working_dir: kept off the processes' PYTHONPATH
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    dashboard_address: str = ""  # the job server, for `ray job submit --address`
    gcs_address: str = ""
    temp_dir: str = ""
    leftovers: list = field(default_factory=list)  # set by stop(): processes that survived SIGKILL
    killed: list = field(default_factory=list)  # set by stop(): processes that needed SIGKILL

    def _ray(self, *args):
        done = subprocess.run(
            [sys.executable, "-c", _RAY_START, *args],
            env=ray_environment(self.cluster_id, self.checkout),
            capture_output=True,
            text=True,
            timeout=180,
        )
        if self.log is not None:
            self.log.write(done.stdout + done.stderr)
            self.log.flush()
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")

    def _node_ports(self):
        return [
            *("--node-ip-address", "127.0.0.1"),
            *("--num-gpus", str(self.gpus_per_node)),
            *("--num-cpus", str(self.cpus_per_node)),
            *("--object-store-memory", str(int(self.object_store_gb * 2**30))),
            *("--node-manager-port", str(_free_port())),
            *("--object-manager-port", str(_free_port())),
            *("--runtime-env-agent-port", str(_free_port())),
            *("--metrics-export-port", str(_free_port())),
            *("--dashboard-agent-listen-port", str(_free_port())),
            *("--dashboard-agent-grpc-port", str(_free_port())),
            *("--min-worker-port", "0"),
            *("--max-worker-port", "0"),
        ]

    def __enter__(self):
        # short: Ray's Unix socket paths live under it (at most 107 characters)
        self.temp_dir = tempfile.mkdtemp(prefix="d3s-smoke-", dir="/tmp")
        gcs_port, dashboard_port = _free_port(), _free_port()
        try:
            self._ray(
                *("--head", "--port", str(gcs_port)),
                *self._node_ports(),
                *("--include-dashboard", "true"),
                *("--dashboard-host", "127.0.0.1"),
                *("--dashboard-port", str(dashboard_port)),
                *("--ray-client-server-port", str(_free_port())),
                *("--temp-dir", self.temp_dir),
                "--disable-usage-stats",
            )
            # each node its own temp dir, as on separate machines: a joining node shares the head's by default, and
            # two runtime-env agents unpacking the job's working_dir into one directory race (a job once imported
            # from a half-unpacked checkout: "No module named d3s_openrlhf.integration.actor")
            for node in range(1, self.nodes):
                node_dir = os.path.join(self.temp_dir, f"n{node}")
                self._ray("--address", f"127.0.0.1:{gcs_port}", *self._node_ports(), "--temp-dir", node_dir)
        except BaseException:
            self.stop()
            raise
        self.dashboard_address = f"http://127.0.0.1:{dashboard_port}"
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self, grace_s=16.0):
        """Stop every process of the cluster by PID, as ``ray stop`` does: SIGTERM, then SIGKILL what is left after
        ``grace_s`` (its default grace period; Ray's GCS and raylet often outlast it, even idle: named in ``killed``).
        Returns "pid: command" of each process that survived SIGKILL."""
        pids = _marked(self.cluster_id)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if sig == signal.SIGKILL:
                self.killed = [f"{pid}: {_command(pid)}" for pid in pids]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.time() + wait
            while pids and time.time() < deadline:
                time.sleep(0.5)
                pids = _marked(self.cluster_id)
            if not pids:
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.leftovers = [f"{pid}: {_command(pid)}" for pid in _marked(self.cluster_id)]
        return self.leftovers


# ------------------------------------------------------------------------------------------------ one run
@dataclass
class Result:
    script: str
    returncode: object  # int, or a text when the run was stopped after the timeout
    log: str
    steps: dict  # {global_step: {metric: value}} as OpenRLHF logged them
    leftovers: list  # cluster processes that survived SIGKILL
    seconds: float

    @property
    def ok(self):
        return (
            self.returncode == 0
            and not self.leftovers
            and list(self.steps) == list(range(1, STEPS + 1))
            and all(math.isfinite(values.get("policy_loss", math.nan)) for values in self.steps.values())
        )

    def summary(self):
        losses = ", ".join(f"{values.get('policy_loss', math.nan):.4g}" for values in self.steps.values())
        state = "ok" if self.ok else f"FAILED (exit {self.returncode}, leftovers {self.leftovers})"
        steps = f"steps {list(self.steps)}  policy_loss [{losses}]"
        return f"{state}  {self.script}  {steps}  {self.seconds:.0f}s  log {self.log}"


def script_name(script):
    return f"{os.path.basename(os.path.dirname(script))}/{os.path.splitext(os.path.basename(script))[0]}"


def script_env(script_vars, runtime_env_vars, extra_env=None):
    """The environment the script runs in: the caller's without common.sh's variables, then ``script_vars``."""
    env = {key: value for key, value in os.environ.items() if key not in COMMON_VARS}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    env.update(script_vars)
    env["D3S_RUNTIME_ENV_VARS"] = json.dumps(runtime_env_vars)
    env.update(extra_env or {})
    return env


# Variables common.sh reads; the caller's values are dropped so that only the script and SWAPPED decide.
COMMON_VARS = frozenset(
    "MODEL DATA EVAL_DATA RAY_ADDRESS NNODES GPUS_PER_NODE ZERO_STAGE TRAIN_MICRO_BATCH ROLLOUT_MICRO_BATCH "
    "CKPT_ROOT RUN_NAME N_SAMPLES ROLLOUT_BATCH TRAIN_BATCH NUM_EPISODES LR KL_COEF SEED MAX_LEN MAX_NEW_TOKENS "
    "EVAL_STEPS SAVE_STEPS VLLM_GPU_UTIL REWARD_FUNC RUNTIME_ENV_JSON RAY_SUBMIT_ARGS D3S_SHIP D3S_LAUNCH "
    "D3S_PRINT_ONLY D3S_RUNTIME_ENV_VARS PYTHON LORA_RANK LORA_ALPHA".split()
)
# What the job's runtime env gets on top of the script's: the CPU runtime's switch, and Ray's permission to
# merge the driver's runtime env (the runtime's setup hook and worker variables) into the job's.
CPU_RUNTIME_ENV_VARS = {"D3S_OPENRLHF_CPU": "1", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}


def checkout_of(script):
    """The checkout a launch script belongs to (``<checkout>/examples/scripts/<model>/<setting>.sh``): what
    common.sh ships to the job as its working_dir."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(script)))))


def dry_run(script, env):
    """The script's command line through the entrypoint's validation (``--d3s.dry_run``), without Ray, with the
    script's own checkout first on the path (the code its job will run)."""
    env = dict(env, D3S_LAUNCH=f"{sys.executable} -m d3s_openrlhf.cli.train_ppo_ray", PYTHONPATH=checkout_of(script))
    done = subprocess.run(
        ["bash", script, *extra_args(), "--d3s.dry_run"], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script_name(script)}: the toy sizes fail the dry run:\n{done.stderr[-3000:]}")
    return done.stdout


def run_script(script, toy_files, outdir, nodes=1, gpus_per_node=1, timeout=600, on_line=None, extra=()):
    """Run ``script`` for :data:`STEPS` steps on a fresh local cluster; returns a :class:`Result`."""
    name = script_name(script)
    run_dir = os.path.join(outdir, name.replace("/", "__") + f"__{nodes}n")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log_path = os.path.join(run_dir, "run.log")
    script_vars = swapped_env(toy_files, os.path.join(run_dir, "ckpt"), nodes, gpus_per_node)
    env = script_env(script_vars, CPU_RUNTIME_ENV_VARS)
    with open(log_path, "a") as log:
        log.write(dry_run(script, env))
    start = time.time()
    with open(log_path, "a") as log, Cluster(
        nodes=nodes, gpus_per_node=gpus_per_node, log=log, checkout=checkout_of(script)
    ) as cluster:
        env["RAY_ADDRESS"] = cluster.dashboard_address
        command = ["bash", script, *extra_args(), *extra]
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        try:
            rc = pipeline.run_logged(command, log_path, on_line=on_line, env=env, timeout=timeout)
        except TimeoutError:
            rc = f"none: stopped after {timeout}s"
    if cluster.killed:
        with open(log_path, "a") as log:
            log.write(f"cluster processes killed after the SIGTERM grace period: {cluster.killed}\n")
    leftovers = cluster.leftovers
    # common.sh's RUN_NAME: <model profile>_<setting>
    tensorboard = os.path.join(script_vars["CKPT_ROOT"], name.replace("/", "_"), "tensorboard")
    return Result(name, rc, log_path, read_train_scalars(tensorboard), leftovers, time.time() - start)


def all_scripts(scripts_dir=SCRIPTS_DIR):
    """Every launch script ``<scripts_dir>/<model>/<setting>.sh``."""
    return sorted(glob.glob(os.path.join(scripts_dir, "*", "*.sh")))


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m d3s_openrlhf.cli.smoke_script",
        description="Run examples/scripts/<model>/<setting>.sh for two steps on the CPU runtime with the toy model.",
    )
    parser.add_argument("scripts", nargs="*", help="launch scripts to run")
    parser.add_argument("--all", action="store_true", help="every script under --scripts-dir")
    parser.add_argument(
        "--scripts-dir",
        default=SCRIPTS_DIR,
        help=f"the launch scripts of a d3s-openrlhf checkout, for --all (default: {SCRIPTS_DIR} in the current "
        "directory)",
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
        options.scripts = all_scripts(options.scripts_dir)
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
        result = run_script(
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
