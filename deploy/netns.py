"""Hosts on one machine: each a Linux network namespace with its own address, wired to one
bridge in a namespace of its own (``ip netns``, veth pairs; needs root). Nothing is attached to
the machine's own network (but by ``attach_here``): traffic between the hosts stays inside their
namespaces.

    host ns (10.200.0.N/24) --veth--  switch ns: br0  --veth-- host ns ...

``NetnsHosts.add(name, last_octet)`` makes a host; ``run``/``popen`` run a command on it;
``cut``/``restore`` take its link down at the switch and up again; ``close`` removes it all.
``attach_here`` wires this process's own namespace to the switch too (one more interface on
the machine, gone with ``close``), for a process that talks to the hosts itself (a benchmark).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import time
from pathlib import Path

SUBNET = "10.200.0"
LINK_UP_TIMEOUT_S = 10.0


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here (not root, or no kernel support)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _connects_over(device: str, address: str) -> bool:
    """Whether a TCP connection to ``address``, both ends bound to ``device``, is made: what a
    transport that binds its sockets to an interface (UCX's) does first, to this host itself."""
    with socket.socket() as server, socket.socket() as client:
        try:
            for sock in (server, client):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
            server.bind((address, 0))
            server.listen(1)
            client.settimeout(1.0)
            client.connect(server.getsockname())
        except OSError:
            return False
    return True


_instances = itertools.count()


class NetnsHosts:
    def __init__(self, subnet: str = SUBNET) -> None:
        self.subnet = subnet  # the hosts' addresses: SUBNET.last_octet
        # NOTE: a name of its own each time: a namespace deleted goes away in the background.
        self.prefix = f"kv{os.getpid() % 100000}{next(_instances) % 10}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, str] = {}  # name -> address
        try:
            _ip("netns", "add", self.switch)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise NetnsUnavailable(f"cannot create a network namespace: {detail.strip()}") from e
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def _switch_port(self, name: str) -> str:
        return f"{self.prefix}{name}s"  # at most 15 characters: names of 6 at most

    def add(self, name: str, last_octet: int) -> str:
        """A new host; its address."""
        namespace, address = self.namespace(name), f"{self.subnet}.{last_octet}"
        _ip("netns", "add", namespace)
        self.hosts[name] = address
        port = self._switch_port(name)
        _ip(
            "link", "add", "eth0", "netns", namespace, "type", "veth",
            "peer", "name", port, "netns", self.switch,
        )  # fmt: skip
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        return address

    def attach_here(self, last_octet: int) -> str:
        """Wire the namespace this process runs in to the switch, at an address of the hosts'
        subnet; that address. Its interface goes with ``close`` (a veth pair dies with either
        end)."""
        address, port = f"{self.subnet}.{last_octet}", self._switch_port("here")
        here = self.here_device
        _ip("link", "add", here, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("addr", "add", f"{address}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        # NOTE: the link comes up a moment after both ends are set up; a program that looks at
        # its interfaces before then finds this one without a carrier (UCX: "no route").
        state = Path(f"/sys/class/net/{here}/operstate")
        deadline = time.monotonic() + LINK_UP_TIMEOUT_S
        while state.read_text().strip() != "up" or not _connects_over(here, address):
            if time.monotonic() > deadline:
                raise NetnsUnavailable(f"{here} did not come up in {LINK_UP_TIMEOUT_S:g} s")
            time.sleep(0.01)
        return address

    @property
    def here_device(self) -> str:
        """``attach_here``'s interface, in this process's namespace (each host's is eth0)."""
        return f"{self.prefix}h"

    def prefix_for(self, name: str) -> list[str]:
        """What runs a command on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def run(self, name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix_for(name), *args], capture_output=True, text=True)

    def popen(self, name: str, *args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix_for(name), *args], **kwargs)

    def cut(self, name: str) -> None:
        """Take the host's link down at the switch: nothing reaches it, nothing says so."""
        _ip("-n", self.switch, "link", "set", self._switch_port(name), "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self._switch_port(name), "up")

    def close(self) -> None:
        for name in self.hosts:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.hosts.clear()
