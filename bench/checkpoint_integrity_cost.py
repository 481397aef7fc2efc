#!/usr/bin/env python3
"""What checkpoint integrity costs: hash throughput, and a few-hundred-MB checkpoint file saved
and loaded with and without the digest (docs/performance.md, "Checkpoint integrity: cost on
save and load").

    python bench/checkpoint_integrity_cost.py --dir /tmp/ckpt_bench --mb 300 --repeats 3

1. MB/s of each candidate digest over 256 MiB in memory (16 MiB chunks, as the verifier reads).
2. One rank's ``--ckpt-format torch`` file of about ``--mb`` MB (bf16 weights + fp32 main params +
   two Adam moments, 14 bytes per parameter), through the trainer's own functions:
   * save before manifests: ``torch.save`` to ``.part`` + rename (no fsync);
   * the same + fsync (what :func:`checkpoint_integrity.save_torch` adds besides the digest);
   * ``save_torch``: digest while writing + fsync + rename;
   * load: ``torch.load`` alone, and :func:`checkpoint_integrity.verify` + ``torch.load``, with
     the file in the page cache (just written) and cold (evicted with ``posix_fadvise``), as on a
     real resume.
Best of ``--repeats`` for each; the machine may be shared, so the best is the least disturbed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megatron.training.checkpoint import integrity as ci  # noqa: E402


def best(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def hash_rates(repeats: int) -> Dict[str, float]:
    data = memoryview(os.urandom(256 << 20))
    chunk = ci.READ_CHUNK

    def hasher(make):
        def run():
            h = make()
            for i in range(0, len(data), chunk):
                h.update(data[i:i + chunk])
            h.hexdigest()
        return run

    def checksum(fn, start):
        def run():
            c = start
            for i in range(0, len(data), chunk):
                c = fn(data[i:i + chunk], c)
        return run

    candidates = {"sha256 (hashlib)": hasher(hashlib.sha256),
                  "blake2b (hashlib)": hasher(hashlib.blake2b),
                  "crc32 (zlib)": checksum(zlib.crc32, 0),
                  "adler32 (zlib)": checksum(zlib.adler32, 1)}
    if ci.DEFAULT_ALGORITHM == "xxh3_128":
        candidates = {"xxh3_128 (xxhash, the default)": hasher(ci.HASHERS["xxh3_128"]),
                      **candidates}
    return {name: len(data) / best(fn, repeats) / 1e6 for name, fn in candidates.items()}


def checkpoint_state(mb: int) -> Dict[str, object]:
    n = mb * 1_000_000 // 14
    torch.manual_seed(0)
    main = torch.randn(n)
    return {"model": {"weight": main.to(torch.bfloat16)},
            "optimizer": {"main": main, "exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)},
            "iteration": 1}


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_costs(directory: str, mb: int, repeats: int) -> List[tuple]:
    os.makedirs(directory, exist_ok=True)
    state = checkpoint_state(mb)
    path = os.path.join(directory, "mp_rank_00_000_dp_000.pt")

    def old_save() -> None:
        torch.save(state, path + ".part")
        os.replace(path + ".part", path)

    def old_save_fsync() -> None:
        with open(path + ".part", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".part", path)

    entries = []

    def new_save() -> None:
        entries[:] = [ci.save_torch(state, path, directory)]

    rows = []
    for label, fn in (("save, before manifests (torch.save + rename)", old_save),
                      ("save + fsync, no digest", old_save_fsync),
                      ("save_torch: digest while writing + fsync", new_save)):
        rows.append((label, best(fn, repeats)))
    size = os.path.getsize(path)
    manifest = ci.write_manifest(directory, 1, entries)

    def load() -> None:
        torch.load(path, map_location="cpu", weights_only=False)

    def verify_load() -> None:
        assert ci.verify(directory, manifest) is None
        load()

    def verify_only() -> None:
        assert ci.verify(directory, manifest) is None

    for cache in ("page cache", "cold"):
        for label, fn in (("load", load), ("verify", verify_only), ("verify + load", verify_load)):
            if cache == "cold":  # the eviction is not timed
                times = []
                for _ in range(repeats):
                    evict(path)
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                rows.append((f"{label} ({cache})", min(times)))
            else:
                fn()  # warm the cache
                rows.append((f"{label} ({cache})", best(fn, repeats)))
    os.remove(path)
    os.remove(os.path.join(directory, ci.MANIFEST))
    return [(label, t, size / t / 1e6) for label, t in rows] + [("file size (MB)", size / 1e6, 0)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/ckpt_integrity_bench")
    p.add_argument("--mb", type=int, default=300, help="checkpoint file size, MB")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| digest | MB/s |\n|---|---:|")
    for name, rate in hash_rates(a.repeats).items():
        print(f"| {name} | {rate:,.0f} |")
    print(f"\n| {a.mb} MB checkpoint file | seconds | MB/s |\n|---|---:|---:|")
    for label, t, rate in file_costs(a.dir, a.mb, a.repeats):
        print(f"| {label} | {t:.3f} | {rate:,.0f} |" if rate else f"| {label} | {t:.1f} | |")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
