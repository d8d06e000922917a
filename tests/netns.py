"""Hosts for multi-host tests: Linux network namespaces on one switch.

    switch namespace:  br0 ── p-redis ─┐  ┌─ p-proxy ── ...
                                       │  │
    host namespaces:          eth0 10.99.0.1   eth0 10.99.0.2   ...

Each host is a namespace with one veth link into a bridge that lives in a namespace of its own
(the switch), so the root namespace gets no interface and no route: nothing the hosts say
reaches the machine's own network, and cutting a host's link is `ip link set p-NAME down` on
the switch (a cable pulled at the switch port). Needs root.

The test process cannot dial into the namespaces, so a small agent (this file run as a script
inside a host with `ip netns exec`) makes HTTP requests on its behalf, one JSON line per request
on its stdin and one JSON line per answer on its stdout. Only the standard library here: the
agent starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

SUBNET = "10.99.0"  # private to the namespaces: no interface outside them has it


class NetnsUnavailable(RuntimeError):
    """Why namespaces cannot be made here (not root, no `ip`, no permission)."""


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def check_available() -> None:
    """Raise NetnsUnavailable, saying why, unless this process can make namespaces."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"epdprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except RuntimeError as e:
        raise NetnsUnavailable(f"`ip netns add` fails here: {e}") from None
    ip("netns", "del", probe)


@dataclass(frozen=True)
class Host:
    name: str  # short, e.g. "lm-a"
    netns: str  # the namespace's name
    address: str  # its IPv4 address on the switch
    port: str  # its veth end on the switch

    def command(self, *argv: str) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Switch:
    """A bridge in its own namespace, and hosts (namespaces) linked to it by veth pairs."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"epd{os.getpid()}"
        self.netns = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            self._add_netns(self.netns)
            ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
            ip("-n", self.netns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        assert len(name) <= 13, "the switch port p-NAME must fit in 15 characters"
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{len(self.hosts) + 1}", f"p-{name}")
        self._add_netns(host.netns)
        ip(
            "-n",
            self.netns,
            "link",
            "add",
            host.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.netns,
        )
        ip("-n", self.netns, "link", "set", host.port, "master", "br0", "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        """Pull the host's cable at the switch: nothing reaches it and nothing leaves it."""
        ip("-n", self.netns, "link", "set", host.port, "down")

    def plug(self, host: Host) -> None:
        ip("-n", self.netns, "link", "set", host.port, "up")

    def close(self) -> None:
        """Delete every namespace made (their veths go with them). Stop the processes first:
        a namespace lives on while a process is in it."""
        errors = []
        for name in reversed(self._made):
            try:
                ip("netns", "del", name)
            except RuntimeError as e:
                errors.append(str(e))
        self._made.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


def netns_inode(pid: int | str) -> str:
    """Which network namespace a process is in ('net:[4026531840]')."""
    return os.readlink(f"/proc/{pid}/ns/net")


class Agent:
    """HTTP from inside a host: this file run as a script with `ip netns exec`."""

    def __init__(self, host: Host):
        self.proc = subprocess.Popen(
            host.command(sys.executable, os.path.abspath(__file__)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def request(self, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
        """(HTTP status, body text); status 0 with the error text when nothing answered."""
        self.proc.stdin.write(json.dumps({"url": url, "body": body, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent exited with {self.proc.wait()}")
        reply = json.loads(line)
        return reply["status"], reply["text"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _agent_main() -> None:
    import urllib.error
    import urllib.request

    for line in sys.stdin:
        ask = json.loads(line)
        data = json.dumps(ask["body"]).encode() if ask["body"] is not None else None
        request = urllib.request.Request(
            ask["url"], data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=ask["timeout"]) as reply:
                status, text = reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        except OSError as e:  # refused, unreachable, timed out
            status, text = 0, str(e)
        print(json.dumps({"status": status, "text": text}), flush=True)


if __name__ == "__main__":
    _agent_main()
