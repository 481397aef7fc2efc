"""Checkpoint integrity: every file's size and digest in a manifest, checked before a load.

Why: neither format notices damaged bytes (torch's zip reader skips its CRC checks, ``.distcp``
shards carry none), so flipped or truncated bytes loaded silently or failed naming no file. With
``{iter_dir}/manifest.json`` a damaged checkpoint is refused before anything loads, naming the file
and pointing at the previous checkpoint. Writers hash their own files while writing
(:func:`save_torch`, :func:`digest_own_distcp_files`), rank 0 the rest (:func:`write_manifest`);
:func:`verify` splits the check over the loading ranks. See [Note: checkpoint manifest] in
docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from megatron.training.errors import StartupError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "checkpoint-manifest"
MANIFEST_VERSION = 2
"""2: the manifest carries a digest of itself (``self_sha256``); 1 had none."""
WRITER_NOTE = "checkpoint_writer.json"
"""Written beside the manifest (and listed in it) by every save that writes one: a checkpoint
whose manifest is missing but that has this file lost its manifest; one with neither was
written before manifests existed."""
READ_CHUNK = 16 << 20
"""Bytes per read when hashing a file (large enough to amortize the Python call per chunk)."""
PARALLEL_MIN = 1 << 20
"""Chunks of ``torch.save`` at least this large are hashed on the helper thread while written;
smaller ones (pickled headers, small tensors) inline, where a thread hand-off would cost more."""


def _xxh3_128() -> Any:
    import xxhash

    return xxhash.xxh3_128()


HASHERS: Dict[str, Callable[[], Any]] = {"xxh3_128": _xxh3_128, "sha256": hashlib.sha256}
"""Digest algorithms a manifest may name: name -> a fresh hasher (``update`` / ``hexdigest``)."""


def _default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


DEFAULT_ALGORITHM = _default_algorithm()


class CheckpointIntegrityError(StartupError):
    """A checkpoint file is missing, truncated, unreadable or does not match its digest."""


@dataclass(frozen=True)
class FileDigest:
    """One checkpoint file as it was written."""

    name: str
    """Path relative to the iteration directory, ``/``-separated."""
    size: int
    """Bytes written: a shorter file is truncated."""
    digest: str
    """Hex digest of the whole file with the manifest's algorithm."""


@dataclass(frozen=True)
class Manifest:
    """The contents of one ``manifest.json``."""

    iteration: int
    algorithm: str
    files: Tuple[FileDigest, ...]

    def to_json(self) -> Dict[str, Any]:
        body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "iteration": self.iteration, "algorithm": self.algorithm,
                "files": {f.name: {"size": f.size, "digest": f.digest}
                          for f in sorted(self.files, key=lambda f: f.name)}}
        return {**body, "self_sha256": _self_digest(body)}


def _self_digest(body: Dict[str, Any]) -> str:
    """sha256 of the manifest's other fields in a canonical form (hashlib: always there, so a
    manifest verifies itself before its algorithm is trusted). Why: one changed byte in the
    manifest blamed an intact data file ("does not match its digest", "is truncated", "is
    missing") and sent the user back to an older checkpoint."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Any:
    try:
        factory = HASHERS[algorithm]
    except KeyError:
        raise CheckpointIntegrityError(f"unknown checkpoint digest algorithm {algorithm!r} "
                                       f"(known: {', '.join(HASHERS)})") from None
    try:
        return factory()
    except ImportError:
        raise CheckpointIntegrityError(
            f"the checkpoint's manifest uses {algorithm}, which needs the 'xxhash' package: "
            "pip install xxhash, or load with --no-verify-checkpoint") from None


# ----------------------------------------------------------------------------- writing
class DigestingWriter:
    """A write-only file object that hashes what passes through it (for ``torch.save``).

    Each chunk of at least :data:`PARALLEL_MIN` bytes is hashed on ``pool`` while this thread
    writes it; the hash is joined before the call returns, so chunks are hashed in order and
    the caller's buffer (torch hands out views of its own memory) outlives both uses."""

    def __init__(self, f: Any, algorithm: str = DEFAULT_ALGORITHM,
                 pool: Optional[ThreadPoolExecutor] = None) -> None:
        self._f = f
        self._hasher = new_hasher(algorithm)
        self._pool = pool
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        n = view.nbytes
        if self._pool is not None and n >= PARALLEL_MIN:
            pending = self._pool.submit(self._hasher.update, view)
            try:
                self._f.write(view)
            finally:
                pending.result()
        else:
            self._hasher.update(view)
            self._f.write(view)
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def save_torch(obj: Any, path: str, directory: str,
               algorithm: str = DEFAULT_ALGORITHM) -> FileDigest:
    """``torch.save(obj, path)`` atomically (``.part`` + rename), hashing while writing.

    The data is fsynced before the rename: the manifest, and then the tracker, must not name
    bytes that a power loss could still take back."""
    import torch

    part = path + ".part"
    with open(part, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="ckpt-digest") as pool:
        writer = DigestingWriter(f, algorithm, pool)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    return FileDigest(_relative(path, directory), writer.size, writer.hexdigest())


def digest_file(path: str, algorithm: str = DEFAULT_ALGORITHM) -> Tuple[int, str]:
    """(size, hex digest) of a file, read in :data:`READ_CHUNK` pieces."""
    hasher = new_hasher(algorithm)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def digest_files(directory: str, names: Iterable[str],
                 algorithm: str = DEFAULT_ALGORITHM) -> List[FileDigest]:
    out = []
    for name in names:
        size, digest = digest_file(os.path.join(directory, name), algorithm)
        out.append(FileDigest(name, size, digest))
    return out


def digest_own_distcp_files(directory: str, rank: int,
                            algorithm: str = DEFAULT_ALGORITHM) -> List[FileDigest]:
    """The ``.distcp`` shards this rank's data went to (torch DCP names them ``__{rank}_{n}``).

    Why after the save and not during it: megatron-core writes them in its own writer
    processes; they were just written, so this reads the page cache, not the disk."""
    own = re.compile(rf".*__{rank}_\d+\.distcp")  # an optional group prefix, then DCP's name
    return digest_files(directory, sorted(n for n in os.listdir(directory) if own.fullmatch(n)),
                        algorithm)


def _relative(path: str, directory: str) -> str:
    return os.path.relpath(path, directory).replace(os.sep, "/")


def _all_files(directory: str) -> List[str]:
    names = []
    for parent, _, files in os.walk(directory):
        names += [_relative(os.path.join(parent, f), directory) for f in files]
    return sorted(n for n in names if n != MANIFEST and not n.endswith(".part"))


def write_manifest(directory: str, iteration: int, entries: Iterable[FileDigest],
                   algorithm: str = DEFAULT_ALGORITHM) -> Manifest:
    """Write ``{directory}/manifest.json`` (atomically, fsynced) listing every file there.

    ``entries`` are the digests the writers computed; a file nobody claimed is hashed here, so
    the manifest covers the whole directory whatever wrote into it."""
    known = {e.name: e for e in entries}
    with open(os.path.join(directory, WRITER_NOTE), "w", encoding="utf-8") as f:
        json.dump({"manifest": MANIFEST, "manifest_version": MANIFEST_VERSION}, f)
        f.flush()
        os.fsync(f.fileno())
    missing = [n for n in known if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise RuntimeError(f"checkpoint {directory}: files hashed by their writers are gone: "
                           f"{missing[:4]}")
    unclaimed = [n for n in _all_files(directory) if n not in known]
    for entry in digest_files(directory, unclaimed, algorithm):
        known[entry.name] = entry
    manifest = Manifest(iteration, algorithm, tuple(known.values()))
    tmp = os.path.join(directory, f".{MANIFEST}.part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    return manifest


# ----------------------------------------------------------------------------- reading
def read_manifest(directory: str) -> Optional[Manifest]:
    """The manifest of an iteration directory; None when it has none (written before manifests
    existed).  A manifest that cannot be parsed is itself damage: an error naming it."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        version = int(raw.get("version", 0))
        if version > MANIFEST_VERSION:
            raise ValueError(f"version {raw['version']} is newer than this trainer's "
                             f"{MANIFEST_VERSION}")
        if version >= 2:
            body = {k: v for k, v in raw.items() if k != "self_sha256"}
            if raw.get("self_sha256") != _self_digest(body):
                raise CheckpointIntegrityError(damaged(
                    directory, path, "does not match its own digest: the manifest was changed "
                    "after the save, so it cannot tell which file is intact (no data file was "
                    "checked against it)", extra="or pass --no-verify-checkpoint to load this "
                    "checkpoint unverified"))
        files = tuple(FileDigest(name, int(v["size"]), str(v["digest"]))
                      for name, v in raw["files"].items())
        algorithm = str(raw["algorithm"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointIntegrityError(damaged(directory, path, f"cannot be read ({exc})")) \
            from None
    if algorithm not in HASHERS:
        raise CheckpointIntegrityError(damaged(
            directory, path, f"names the digest algorithm {algorithm!r}, which this trainer does "
            f"not know ({', '.join(HASHERS)})", extra="or pass --no-verify-checkpoint to load "
            "this checkpoint unverified"))
    return Manifest(int(raw["iteration"]), algorithm, files)


def require_manifest(directory: str, load_flag: Optional[Callable[[int], str]] = None
                     ) -> Optional[Manifest]:
    """:func:`read_manifest`, and an error when the manifest is missing from a checkpoint whose
    writer wrote one (:data:`WRITER_NOTE`): deleting ``manifest.json`` turned verification off
    with a note that the checkpoint predated manifests, and a damaged file then loaded. None
    only for a checkpoint written before manifests."""
    manifest = read_manifest(directory)
    if manifest is None and os.path.isfile(os.path.join(directory, WRITER_NOTE)):
        raise CheckpointIntegrityError(damaged(
            directory, os.path.join(directory, MANIFEST), f"is missing, but the checkpoint was "
            f"written with one ({WRITER_NOTE} says so): none of its files can be verified",
            load_flag or ckpt_step_flag, extra="or pass --no-verify-checkpoint to load this checkpoint "
            "unverified"))
    return manifest


def check_file(directory: str, entry: FileDigest, algorithm: str) -> Optional[str]:
    """What is wrong with one file (a phrase after its path), or None when it matches."""
    path = os.path.join(directory, entry.name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size < entry.size:
        return f"is truncated: {size} bytes, the manifest says {entry.size}"
    if size > entry.size:
        return f"has {size} bytes, the manifest says {entry.size}"
    try:
        _, digest = digest_file(path, algorithm)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if digest != entry.digest:
        return (f"does not match its {algorithm} digest in the manifest (the contents changed "
                "after the save: the file is corrupt)")
    return None


def files_for_rank(manifest: Manifest, rank: int, world: int,
                   select: Optional[Callable[[str], bool]] = None) -> List[FileDigest]:
    """This rank's share of the files to verify: largest first, each to the least loaded rank
    (the same answer on every rank, so every file is checked exactly once)."""
    files = [f for f in manifest.files if select is None or select(f.name)]
    load = [0] * world
    mine = []
    for f in sorted(files, key=lambda f: (-f.size, f.name)):
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += f.size
        if target == rank:
            mine.append(f)
    return mine


def verify(directory: str, manifest: Manifest, rank: int = 0, world: int = 1,
           select: Optional[Callable[[str], bool]] = None) -> Optional[Tuple[str, str]]:
    """Check this rank's share of ``directory``'s files; the first (path, problem), or None."""
    for entry in files_for_rank(manifest, rank, world, select):
        problem = check_file(directory, entry, manifest.algorithm)
        if problem is not None:
            return os.path.join(directory, entry.name), problem
    return None


def iterations_in(root: str) -> List[int]:
    """The iterations that have an ``iter_NNNNNNN`` directory under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(re.compile(r"iter_(\d+)$").match, names) if m)


def previous_checkpoint(root: str, iteration: int) -> Optional[int]:
    """The latest iteration before ``iteration`` whose directory has a manifest (a checkpoint
    that was completed: the manifest is written last), or None."""
    for it in reversed(iterations_in(root)):
        if it < iteration and os.path.isfile(os.path.join(root, f"iter_{it:07d}", MANIFEST)):
            return it
    return None


def ckpt_step_flag(iteration: int) -> str:
    """How the trainer loads another iteration of the same ``--load`` directory."""
    return f"--ckpt-step {iteration}"


def damaged(directory: str, path: str, problem: str,
            load_flag: Callable[[int], str] = ckpt_step_flag, extra: str = "") -> str:
    """The error for a damaged file: the file, the checkpoint, and the previous checkpoint to
    resume from instead (``load_flag(N)``: the flags that load iteration N); ``extra``: another
    way out, appended."""
    root, name = os.path.split(os.path.normpath(directory))
    m = re.match(r"iter_(\d+)$", name)
    iteration = int(m.group(1)) if m else None
    where = f"checkpoint {directory}" + (f" (iteration {iteration})" if m else "")
    prev = previous_checkpoint(root, iteration) if iteration is not None else None
    advice = (f"the previous complete checkpoint is iteration {prev}: load it with "
              f"{load_flag(prev)}" if prev is not None
              else f"there is no earlier complete checkpoint in {root}")
    return f"{where} is damaged: {path} {problem}; {advice}" + (f", {extra}" if extra else "")


READ_ERRORS = (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
               zipfile.BadZipFile, KeyError, AttributeError, IndexError)
"""What ``torch.load`` raises on a truncated or corrupt file (the zip reader's RuntimeError,
the unpickler's errors on garbage)."""


def torch_load(path: str, directory: str, load_flag: Callable[[int], str] = ckpt_step_flag,
               **kwargs: Any) -> Any:
    """``torch.load`` whose failure on a damaged file is one clear error naming the file and the
    checkpoint (also with ``--no-verify-checkpoint``, or for a checkpoint without manifest)."""
    import torch

    try:
        return torch.load(path, **kwargs)
    except FileNotFoundError:
        raise CheckpointIntegrityError(damaged(directory, path, "is missing", load_flag)) \
            from None
    except READ_ERRORS as exc:
        raise unreadable(directory, path, exc, load_flag) from None


def unreadable(directory: str, path: str, exc: BaseException,
               load_flag: Callable[[int], str] = ckpt_step_flag) -> CheckpointIntegrityError:
    """The error for a file of ``directory`` its reader could not read (truncated or corrupt),
    with the reader's first sentence (torch's zip errors go on with generic advice)."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
    return CheckpointIntegrityError(damaged(
        directory, path, f"cannot be read: it is truncated or corrupt ({reason})", load_flag))
