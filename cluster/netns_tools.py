"""The host's side of the namespace harness (cluster/netns.py): shell commands, the
namespaces themselves, and the commands a node runs."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvray.errors import InvalidArgumentError

CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    pass


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def ensure_debian_package(command: str, package: str) -> None:
    """Install `package` from Debian's registry when `command` is not on PATH."""
    if shutil.which(command) or Path("/usr/sbin", command).exists():
        return
    sh("apt-get", "install", "-y", "-q", "--no-install-recommends", package)


def check_can_run() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (`ip`, `tc`) is not installed"
    return None


def enter_namespace(ns: str) -> None:
    """Move the calling thread (only it) into network namespace `ns` for good."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise NetnsError(f"setns({ns}): {os.strerror(ctypes.get_errno())}")


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line]


def kill_namespace(ns: str) -> int:
    """SIGKILL what runs in `ns` until nothing does (a dying Ray can still fork)."""
    killed = 0
    for _ in range(50):
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise NetnsError(f"processes in {ns} survive SIGKILL")


def parse_rate(rate: str) -> int:
    """tc's rate spelling (`100mbit`, `1gbit`, `10gbit`, `500kbit`) in bits per second."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise InvalidArgumentError("rate", rate, "a rate such as 100mbit, 1gbit or 10gbit")


def ray_command(name: str = "ray") -> str:
    """The `ray` (or `name`) script of this interpreter's environment."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name) or name


def kvray_command() -> str:
    return ray_command("kvray")
