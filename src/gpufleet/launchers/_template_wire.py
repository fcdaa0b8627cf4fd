"""What the kept template and its callers say to each other (``template.py``, the caller's side;
``_template_server.py``, the template's): a message is a 4-byte length and a JSON body; a
request carries the caller's stdin, stdout and stderr as ``SCM_RIGHTS`` descriptors.

    caller -> template   {"fingerprint", "argv", "env", "cwd", "umask", "limits", "affinity",
                          "caller"} and three descriptors
    template -> caller   {"pid": N} (the agent is forked), or {"refused": "stale"}
                         later, once the agent ended: {"exit": CODE} (as Popen.returncode)
"""

from __future__ import annotations

import json
import resource
import socket
import struct

RLIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NPROC",
           "RLIMIT_MEMLOCK", "RLIMIT_CPU", "RLIMIT_FSIZE")
STREAMS = 3  # stdin, stdout, stderr
_LENGTH = struct.Struct("!I")


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    head = _LENGTH.pack(len(body))
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(body)
    else:
        sock.sendall(head + body)


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) at end of stream."""
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, STREAMS)
    if not head:
        return None, fds
    head += _exactly(sock, _LENGTH.size - len(head))
    (size,) = _LENGTH.unpack(head)
    return json.loads(_exactly(sock, size)), fds


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the template's connection closed in the middle of a message")
        data += chunk
    return data


def limits() -> dict[str, list[int]]:
    """This process's resource limits (soft, hard) by name."""
    return {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS if hasattr(resource, name)}
