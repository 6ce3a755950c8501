"""CPU time of a server's processes and of this client over a measurement: who was short of CPU.

A worker's serving process runs one Python interpreter (gRPC, output processing): where its main
thread's share nears one core, more streams get no more tokens from it, however fast the device.
Read from ``/proc`` (Linux), so measuring costs the measured processes nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time so far (``/proc/<pid>/stat`` fields 14 and 15) of a process, or of
    one of its threads (``tid``: the main thread's is the pid)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(pid: int) -> list[int]:
    """The running children of ``pid``, whichever of its threads started them."""
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as listed:
                kids += [int(kid) for kid in listed.read().split()]
    return kids


def role(pid: int, root: int) -> str:
    """``serving`` (the worker's own process), ``engine`` (its ``--engine-process`` child) or
    ``helper`` (multiprocessing's resource tracker and the like). With ``--api-server-count`` the
    other serving processes are spawned too and count as ``engine`` here (their command lines are
    the same); bench/bench_serving_processes.py splits them from the worker's log."""
    if pid == root:
        return "serving"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read()
    except OSError:
        return "helper"
    return "engine" if b"spawn_main" in command else "helper"


@dataclass
class CpuSnapshot:
    """CPU seconds by role (process total, main thread) of the worker ``root`` and its children,
    and this client's, at one moment."""

    root: int
    at: float
    roles: dict[str, tuple[float, float]]
    client: float


def snapshot(root: int) -> CpuSnapshot:
    """The CPU used so far by the worker ``root``'s processes, by role, and by this client."""
    roles: dict[str, tuple[float, float]] = {}
    for pid in [root, *children(root)]:
        with contextlib.suppress(OSError):  # ended meanwhile
            total, main = cpu_seconds(pid), cpu_seconds(pid, pid)
            name = role(pid, root)
            before = roles.get(name, (0.0, 0.0))
            roles[name] = (before[0] + total, before[1] + main)
    return CpuSnapshot(root, time.perf_counter(), roles, time.process_time())


def cpu_line(before: CpuSnapshot, after: CpuSnapshot, tokens: int) -> str:
    """What each process used between two snapshots: cores (CPU seconds per second of wall time),
    its main thread's cores in brackets, and CPU ms per 1000 tokens; the client last."""
    wall = max(after.at - before.at, 1e-9)
    per_1000 = 1e6 / max(tokens, 1)
    parts = []
    for name in ("serving", "engine"):
        if name in after.roles and name in before.roles:
            total = after.roles[name][0] - before.roles[name][0]
            main = after.roles[name][1] - before.roles[name][1]
            cores = f"{total / wall:.2f} cores (main thread {main / wall:.2f})"
            parts.append(f"{name} {cores}, {total * per_1000:.0f} ms")
    client = after.client - before.client
    parts.append(f"client {client / wall:.2f} cores, {client * per_1000:.0f} ms")
    return "cpu per 1000 tokens: " + "; ".join(parts)
