"""The job secret and what is derived from it: HMAC keys, signed store values, authenticated connections.

Why: every port a job opens (peer-copy receivers, store servers) can be reached by whoever can reach the
host. A per-job secret, known only to the job's agents and workers, lets a receiver refuse anyone else and
lets an agent refuse a failure or generation record it did not see signed.

Where the secret comes from (`job_secret`):
- `--job-secret-file PATH` (e.g. a mounted Kubernetes Secret) or `HYPERPODRUN_JOB_SECRET`: the user gives every
  node the same secret. Required for authenticated multi-node jobs.
- otherwise, on a single node, the agent creates a random one; it never leaves the machine (it is kept in
  the agent's memory and handed to its own children in `HYPERPODRUN_JOB_KEY`, an environment only the same
  user and root can read).
- otherwise (several nodes, no secret) the agents agree on a random one through the coordination store, and
  the agent says once that the ports then trust whoever can reach that store.
With several nodes the agents check at the rendezvous that they hold the same secret (agent/coordination/rendezvous.py,
through an HMAC of the run id: the secret itself never goes through the store).

The workers never see the job secret itself, only `derive(secret, "worker")` in `HYPERPODRUN_JOB_KEY`; keys
for one purpose are derived from that (`derive(key, purpose)`), so a leaked key of one purpose does not
authenticate another: the agents sign their store records with `derive(secret, "store")`
(agent/coordination/job_state.py), the peer-copy connections authenticate with `derive(worker key, "peer-copy")`
(state/restore/peer_copy.py), and each connection's messages with the session key its handshake returns.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
from typing import Mapping, Optional

from hyperpodrun import env
from hyperpodrun.launch import settings
from hyperpodrun.errors import AuthError, ConfigError
from hyperpodrun.launch.settings import MAX_SECRET_BYTES, MIN_SECRET_BYTES, SECRET_ENV  # noqa: F401 (re-exported)

#: environment variable through which an agent hands the workers' key to its own children (hex)
WORKER_KEY_ENV = "HYPERPODRUN_JOB_KEY"

_NONCE = 32
_MAC = hashlib.sha256().digest_size


def read_secret_file(path: str, flag: str = "--job-secret-file", what: str = "job secret") -> bytes:
    """The secret in `path` (`flag`'s file: the job secret, or the status API's token); refuses a file every user
    can write (anyone could then choose the key, or the token that stops the job)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # a mounted Kubernetes Secret is a symlink
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({exc.strerror or exc}); give a readable file")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag} {path!r} is not a regular file")
        if st.st_mode & 0o002:
            raise ConfigError(f"{flag} {path!r} is writable by every user; chmod o-w it (e.g. chmod 0400)")
        if st.st_size > MAX_SECRET_BYTES:
            raise ConfigError(f"{flag} {path!r} has {st.st_size} bytes; a {what} is at most {MAX_SECRET_BYTES}")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return settings.check_secret(data, f"{flag} {path!r}", what)


def read_api_token(path: str) -> bytes:
    """The bearer token of the status API's mutating calls (`--api-token-file`, agent/observe/http_api.py):
    read like the job secret, and as long (at least MIN_SECRET_BYTES), so that it cannot be guessed."""
    return read_secret_file(path, "--api-token-file", "token")


def job_secret(secret_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The user's job secret (file first, then HYPERPODRUN_JOB_SECRET, read by hyperpodrun/launch/settings.py), or
    None when none was given. `environ`: read the variable from there instead of this process's settings."""
    if secret_file:
        return read_secret_file(secret_file)
    if environ is None:
        return settings.job_secret()
    value = settings.read("job_secret", environ)
    return value.get_secret_value() if value is not None else None


def checked_secret_file(secret_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """`secret_file` once the secret it names (or HYPERPODRUN_JOB_SECRET) is usable: the CLI checks it before
    the agent starts, so a bad secret is a usage error (ConfigError) and not a failure of the job."""
    job_secret(secret_file, environ)
    return secret_file


def new_secret() -> bytes:
    """A fresh random secret (single-node jobs, or agreed through the store without a user secret)."""
    return secrets.token_hex(32).encode()


def derive(key: bytes, purpose: str) -> bytes:
    """The key for `purpose` (e.g. "worker", "peer-copy", "store"), one-way from `key`."""
    return hmac.new(key, b"hyperpodrun/" + purpose.encode(), hashlib.sha256).digest()


def worker_key(environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """In a worker: the key its agent handed down (HYPERPODRUN_JOB_KEY, hyperpodrun/env.py), or None outside
    hyperpodrun."""
    return env.worker_context(environ).job_key


# ------------------------------------------------------------------ signed values (store records)
def sign(key: bytes, value: bytes) -> bytes:
    """`value` with an HMAC tag in front, for a store record only the job's agents may write."""
    return hmac.new(key, value, hashlib.sha256).hexdigest().encode() + b"." + value


def verify(key: bytes, signed: bytes) -> bytes:
    """The value of a `sign`ed record; AuthError when the tag does not match (written by someone else)."""
    tag, sep, value = signed.partition(b".")
    if not sep or not hmac.compare_digest(tag, hmac.new(key, value, hashlib.sha256).hexdigest().encode()):
        raise AuthError("a store record is not signed with the job's key (written by someone outside the job)")
    return value


# ------------------------------------------------------------------ authenticated connections
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("connection closed during authentication")
        buf += chunk
    return bytes(buf)


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"".join(struct.pack("<I", len(p)) + p for p in parts), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, key: bytes, context: bytes = b"") -> bytes:
    """Mutual challenge-response on an accepted connection; raises AuthError unless the client knows `key`.
    Nothing but 32-byte nonces and MACs is read before the client has proved itself.

    Returns the session key (both ends compute the same, fresh for every connection) with which the
    messages that follow are authenticated (`message_mac`), so that the rest of the stream cannot be
    replaced or replayed by someone who can inject into the connection."""
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(mine)
    theirs = _recv_exact(sock, _NONCE)
    proof = _recv_exact(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(key, b"client", context, mine, theirs)):
        raise AuthError("the client does not know the job's key")
    sock.sendall(_mac(key, b"server", context, theirs, mine))
    return _mac(key, b"session", context, mine, theirs)


def client_handshake(sock: socket.socket, key: bytes, context: bytes = b"") -> bytes:
    """The client side of `server_handshake` (returns the same session key); AuthError when the server does
    not know `key` either."""
    theirs = _recv_exact(sock, _NONCE)
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(mine + _mac(key, b"client", context, theirs, mine))
    proof = _recv_exact(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(key, b"server", context, mine, theirs)):
        raise AuthError("the server does not know the job's key")
    return _mac(key, b"session", context, theirs, mine)


def message_mac(session: bytes, seq: int) -> "hmac.HMAC":
    """A running MAC for message number `seq` of a session; feed it the message with update()."""
    return hmac.new(session, struct.pack("<Q", seq), hashlib.sha256)


MAC_BYTES = _MAC


def hand_down_key(environ: dict[str, str], secret: bytes) -> None:
    """Give the workers (and the warm spawner) the workers' key, derived one-way from the job secret, and
    never the secret itself: a rank can authenticate peer copies, not sign the agents' records. Here, not in
    env.py, so that the contract of names (env) does not import the keys (auth)."""
    environ.pop(SECRET_ENV, None)
    environ[env.HYPERPODRUN_JOB_KEY] = derive(secret, "worker").hex()
