"""A Ray cluster of one or more nodes on this machine, for the launch-script smoke runs: a head (``ray start
--head``) and ``nodes - 1`` more nodes, every one bound to 127.0.0.1 with its own ports and fake GPUs, the dashboard
(job server) on 127.0.0.1 too. Every process of the cluster carries a marker in its environment and is stopped by
PID when the cluster is left (``processes``; ``ray stop`` would stop other users' clusters on the machine too).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from d3s_openrlhf.cpu.ports import free_port
from d3s_openrlhf.cpu.runtime import RAY_START_ATTEMPTS, RAY_START_TIMEOUT
from d3s_openrlhf.testbed.processes import command_line, marked_processes

MARKER = "D3S_SMOKE_CLUSTER"


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


class StartTimedOut(RuntimeError):
    """A node of the cluster missed Ray's start-up wait."""


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
            error = StartTimedOut if RAY_START_TIMEOUT in done.stdout + done.stderr else RuntimeError
            raise error(f"ray start {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")

    def _node_ports(self):
        return [
            *("--node-ip-address", "127.0.0.1"),
            *("--num-gpus", str(self.gpus_per_node)),
            *("--num-cpus", str(self.cpus_per_node)),
            *("--object-store-memory", str(int(self.object_store_gb * 2**30))),
            *("--node-manager-port", str(free_port())),
            *("--object-manager-port", str(free_port())),
            *("--runtime-env-agent-port", str(free_port())),
            *("--metrics-export-port", str(free_port())),
            *("--dashboard-agent-listen-port", str(free_port())),
            *("--dashboard-agent-grpc-port", str(free_port())),
            *("--min-worker-port", "0"),
            *("--max-worker-port", "0"),
        ]

    def __enter__(self):
        """Start the cluster; started again from nothing when a node missed Ray's fixed start-up wait (see
        :func:`d3s_openrlhf.cpu.runtime.init_local_ray`), up to ``RAY_START_ATTEMPTS`` times."""
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                self._start()
                return self
            except StartTimedOut:
                self.stop()
                if attempt == RAY_START_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise

    def _start(self):
        # short: Ray's Unix socket paths live under it (at most 107 characters)
        self.temp_dir = tempfile.mkdtemp(prefix="d3s-smoke-", dir="/tmp")
        gcs_port, dashboard_port = free_port(), free_port()
        self._ray(
            *("--head", "--port", str(gcs_port)),
            *self._node_ports(),
            *("--include-dashboard", "true"),
            *("--dashboard-host", "127.0.0.1"),
            *("--dashboard-port", str(dashboard_port)),
            *("--ray-client-server-port", str(free_port())),
            *("--temp-dir", self.temp_dir),
            "--disable-usage-stats",
        )
        # each node its own temp dir, as on separate machines: a joining node shares the head's by default, and
        # two runtime-env agents unpacking the job's working_dir into one directory race (a job once imported
        # from a half-unpacked checkout: "No module named d3s_openrlhf.integration.actor")
        for node in range(1, self.nodes):
            node_dir = os.path.join(self.temp_dir, f"n{node}")
            self._ray("--address", f"127.0.0.1:{gcs_port}", *self._node_ports(), "--temp-dir", node_dir)
        self.dashboard_address = f"http://127.0.0.1:{dashboard_port}"
        self.gcs_address = f"127.0.0.1:{gcs_port}"

    def __exit__(self, *exc):
        self.stop()

    def stop(self, grace_s=16.0):
        """Stop every process of the cluster by PID, as ``ray stop`` does: SIGTERM, then SIGKILL what is left after
        ``grace_s`` (its default grace period; Ray's GCS and raylet often outlast it, even idle: named in ``killed``).
        Returns "pid: command" of each process that survived SIGKILL."""
        pids = marked_processes(MARKER, self.cluster_id)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if sig == signal.SIGKILL:
                self.killed = [f"{pid}: {command_line(pid)}" for pid in pids]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.time() + wait
            while pids and time.time() < deadline:
                time.sleep(0.5)
                pids = marked_processes(MARKER, self.cluster_id)
            if not pids:
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.leftovers = [f"{pid}: {command_line(pid)}" for pid in marked_processes(MARKER, self.cluster_id)]
        return self.leftovers
