"""The processes of a run, found by a marker in their environment (``MARKER=<id>``, which every descendant
inherits), read from ``/proc``: what the smoke runner's cluster and the end-to-end tests stop and check for
leftovers by PID (``ray stop`` would stop other users' clusters on the machine too)."""

import os


def marked_processes(marker, run_id):
    """PIDs of live processes whose environment carries ``marker=run_id``."""
    needle = f"{marker}={run_id}".encode()
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


def command_line(pid, width=120):
    """The first ``width`` characters of ``pid``'s command line (all of it with None), "?" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:width]
    except OSError:
        return "?"
