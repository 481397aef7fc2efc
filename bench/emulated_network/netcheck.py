"""Tiny TCP throughput probe for the emulated link (no third-party tools needed).

    python netcheck.py server HOST PORT            # receives until the peer closes, prints MB/s
    python netcheck.py client HOST PORT MBYTES     # sends MBYTES MiB, prints MB/s
    python netcheck.py counters IFNAME             # tx/rx bytes of an interface (this netns)

Run server and client in different namespaces to measure the veth link, or both in one namespace
against that namespace's own veth address to show the traffic stays on `lo` (the veth counters do
not move).
"""

from __future__ import annotations

import json
import socket
import sys
import time


def counters(ifname: str) -> dict:
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/{ifname}/statistics/{key}") as f:
            out[key] = int(f.read())
    return out


def server(host: str, port: int) -> dict:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)
        s.settimeout(60)
        conn, _ = s.accept()
        total, t0 = 0, None
        with conn:
            buf = bytearray(1 << 20)
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                total += n
        dt = time.perf_counter() - (t0 or time.perf_counter())
    return {"role": "server", "bytes": total, "seconds": dt, "MB_per_s": total / max(dt, 1e-9) / 1e6}


def client(host: str, port: int, mbytes: int) -> dict:
    payload = b"\0" * (1 << 20)
    for _ in range(100):
        try:
            s = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"cannot connect to {host}:{port}")
    with s:
        t0 = time.perf_counter()
        for _ in range(mbytes):
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # wait for the server to close
        dt = time.perf_counter() - t0
    total = mbytes << 20
    return {"role": "client", "bytes": total, "seconds": dt, "MB_per_s": total / dt / 1e6}


def main(argv):
    if argv[0] == "server":
        print(json.dumps(server(argv[1], int(argv[2]))), flush=True)
    elif argv[0] == "client":
        print(json.dumps(client(argv[1], int(argv[2]), int(argv[3]))), flush=True)
    elif argv[0] == "counters":
        print(json.dumps(counters(argv[1])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
