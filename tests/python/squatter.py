"""A hostile lookup server: binds a socket path as whatever user runs it and records, per
connection, how many bytes and descriptors the client sent. It answers every frame with a
prefix-hit count far beyond any request (what would trip vLLM's scheduler).

Run as another user: `setpriv --reuid=U --regid=U --clear-groups python3 squatter.py SOCK REPORT`.
REPORT gets "ready" once listening, then one line "conn <bytes> <fds>" per closed connection.
Uses only the standard library (it runs under the system interpreter, not the project's venv).
"""

import array
import os
import socket
import struct
import sys


def main() -> None:
    path, report = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o777)
    s.listen(16)
    with open(report, "a") as f:
        f.write("ready\n")
    fd_size = array.array("i").itemsize
    while True:
        c, _ = s.accept()
        got, fds, pending = 0, 0, b""
        while True:
            try:
                data, anc, _, _ = c.recvmsg(1 << 16, socket.CMSG_SPACE(16 * fd_size))
            except OSError:
                break
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += len(payload) // fd_size
            if not data:
                break
            got += len(data)
            pending += data
            while len(pending) >= 12:
                n = struct.unpack_from("<I", pending, 8)[0]
                if len(pending) < 12 + n:
                    break
                pending = pending[12 + n :]
                body = struct.pack("<I", 1_000_000)
                try:
                    c.sendall(b"UMBR" + bytes([0, 0, 0, 0]) + struct.pack("<I", 4) + body)
                except OSError:
                    break
        c.close()
        with open(report, "a") as f:
            f.write(f"conn {got} {fds}\n")


if __name__ == "__main__":
    main()
