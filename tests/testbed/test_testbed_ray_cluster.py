"""testbed/ray_cluster.py and testbed/processes.py: the local Ray cluster of the smoke runs (its nodes' start
commands, without starting Ray) and the process scan it and the end-to-end tests stop their processes by."""

import os
import subprocess
import sys
import uuid

import pytest

from d3s_openrlhf.testbed.processes import command_line, marked_processes
from d3s_openrlhf.testbed.ray_cluster import Cluster, StartTimedOut


def test_every_node_of_the_local_cluster_has_its_own_temp_dir(monkeypatch):
    # as on separate machines: two nodes' runtime-env agents unpacking the job's working_dir into one shared
    # session directory raced, and a two-node job imported a half-unpacked checkout
    starts = []
    monkeypatch.setattr(Cluster, "_ray", lambda self, *args: starts.append(args))
    with Cluster(nodes=3) as cluster:
        temp_dirs = [args[args.index("--temp-dir") + 1] for args in starts]
        assert len(starts) == 3 and len(set(temp_dirs)) == 3
        assert all(d.startswith(cluster.temp_dir) for d in temp_dirs)
        # Ray's Unix sockets live under <temp dir>/session_<date>_<time>_<pid>/sockets/ (at most 107 characters)
        assert max(map(len, temp_dirs)) + len("/session_2026-11-25_14-52-30_737797_1234567/sockets/plasma_store") < 107


@pytest.mark.parametrize("missed", [1, 3])
def test_a_cluster_whose_node_missed_rays_start_up_wait_starts_again_from_nothing(monkeypatch, missed):
    # Ray's fixed 30 s for a raylet to register (CI, two pytest processes on 2 cores): the two-node smoke run's
    # second node once missed it
    starts, stops = [], []
    stop = Cluster.stop

    def ray_start(self, *args):
        starts.append(args)
        if "--address" in args and len(stops) < missed:
            raise StartTimedOut("ray start failed: The current node timed out during startup.")

    monkeypatch.setattr(Cluster, "_ray", ray_start)
    monkeypatch.setattr(Cluster, "stop", lambda self: stops.append(self.temp_dir) or stop(self))
    if missed == 3:
        with pytest.raises(StartTimedOut), Cluster(nodes=2):
            pass
        assert len(stops) == 3
        return
    with Cluster(nodes=2) as cluster:
        assert [args[0] for args in starts] == ["--head", "--address", "--head", "--address"]
        assert len(stops) == 1 and stops[0] != cluster.temp_dir
        assert cluster.gcs_address.endswith(starts[2][starts[2].index("--port") + 1])


def test_the_process_scan_finds_a_marked_child_and_only_while_it_lives():
    run_id = uuid.uuid4().hex
    env = dict(os.environ, D3S_TEST_MARKER=run_id)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        assert marked_processes("D3S_TEST_MARKER", run_id) == [child.pid]
        assert "time.sleep(60)" in command_line(child.pid)
        assert marked_processes("D3S_TEST_MARKER", uuid.uuid4().hex) == []
    finally:
        child.kill()
        child.wait()
    assert marked_processes("D3S_TEST_MARKER", run_id) == []
    assert command_line(child.pid) == "?"
