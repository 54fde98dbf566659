"""Which local address a job's servers listen on, and listening sockets bound there for real.

Why: a server bound to every interface (0.0.0.0) can be reached by anyone who can reach the host. A job
on one node needs only loopback; a job on several nodes needs the one interface its nodes use to reach
each other - the one the coordination store's host is reached through.

torch's TCPStore ignores the host it is given when it serves, so the store servers get a socket made
here (`listen_socket`) through `master_listen_fd`.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Optional

log = logging.getLogger("hyperpodrun")

LOOPBACK = "127.0.0.1"


def _ipv4_of(host: str) -> list[str]:
    """The IPv4 addresses `host` resolves to here, in resolver order (no duplicates); [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(ai[4][0]) for ai in infos))


def addresses_of(host: str) -> list[str]:
    """`host` itself when it is an address, else the IPv4 addresses it resolves to here ([] when none)."""
    return [host] if is_ip_literal(host) else _ipv4_of(host)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def is_bindable(addr: str) -> bool:
    """Whether `addr` is an address of this machine (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError:
        return False
    return True


def route_source(towards: str) -> Optional[str]:
    """This host's source address on the route to `towards` (no packet is sent); None without a route."""
    addrs = [towards] if is_ip_literal(towards) else _ipv4_of(towards)
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def single_node_master(master_addr: str) -> str:
    """The MASTER_ADDR the workers of a single-node job dial: the configured name when it resolves to one
    loopback address only (e.g. `localhost`, or an FQDN that /etc/hosts maps to 127.0.0.1), else
    127.0.0.1 - the workers' store listens on loopback only."""
    addrs = _ipv4_of(master_addr)
    if len(addrs) == 1 and is_loopback(addrs[0]):
        return master_addr
    return LOOPBACK


def single_node_bind(master_addr: str) -> str:
    """The loopback address a single-node job's servers listen on (the one `single_node_master` resolves to)."""
    addrs = _ipv4_of(single_node_master(master_addr))
    return addrs[0] if addrs else LOOPBACK


def multi_node_bind(store_host: str, local_addr: Optional[str] = None) -> str:
    """The address this node's servers listen on in a job of several nodes.

    `--local-addr` when given; else the address `store_host` (the coordination store's host: an address of
    this machine on the store host itself) resolves to here, when it is one of ours; else this host's source
    address on the route to it. A name that resolves to loopback on its own host although other nodes reach
    it through the network (`127.0.1.1` in some /etc/hosts) cannot tell us the interface: then every
    interface, with a warning naming --local-addr."""
    if local_addr:
        addrs = [local_addr] if is_ip_literal(local_addr) else _ipv4_of(local_addr)
        for addr in addrs:
            if is_bindable(addr):
                return addr
        log.warning("--local-addr %s is not an address of this machine; ignoring it", local_addr)
    addrs = [store_host] if is_ip_literal(store_host) else _ipv4_of(store_host)
    local = [a for a in addrs if is_bindable(a)]
    routable = [a for a in local if not is_loopback(a)]
    if routable:
        return routable[0]
    if local and (is_ip_literal(store_host) or store_host == "localhost"):
        return local[0]           # every node on this machine (tests, a loopback rendezvous)
    if local:
        log.warning("%s resolves to loopback (%s) on this host, but other nodes reach it through the network: "
                    "listening on every interface. Give --local-addr ADDRESS (this node's address on the "
                    "job's network) to listen there only", store_host, local[0])
        return "0.0.0.0"
    source = route_source(store_host)
    if source is not None:
        return source
    log.warning("no route to %s: listening on every interface; give --local-addr ADDRESS to listen on one",
                store_host)
    return "0.0.0.0"


def listen_socket(addr: str, port: int, backlog: int = 4096) -> socket.socket:
    """A TCP socket listening on `addr`:`port` (0: a free port). Raises OSError (e.g. the port is taken)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
