#!/usr/bin/env python3
"""Build a small, real text corpus without internet access.

The corpus is made from the Python standard library's own ``.py`` sources, which exist on
every machine that has Python installed.  Output is JSON lines, one ``{"text": ...}`` record
per source file, in a deterministic (sorted path) order so that reruns produce identical files.

Example:
    python tools/make_quickstart_corpus.py --output data/quickstart/corpus.jsonl --max-bytes 4000000
"""

import argparse
import json
import os
import re
import sys
import sysconfig

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def iter_source_files(root):
    """Yield ``.py`` files under ``root`` in sorted, reproducible order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


# Preferred split points, coarse to fine: a blank line before a column-0 statement, any blank
# line, any line break.  Finer levels are used only for blocks still longer than max_chars.
_BREAKS = (re.compile(r"\n\n+(?=\S)"), re.compile(r"\n\n+"), re.compile(r"\n"))


def _pieces(text, max_chars, level=0):
    if len(text) <= max_chars or level >= len(_BREAKS):
        return [text]
    out, pos = [], 0
    for m in _BREAKS[level].finditer(text):
        out.append(text[pos:m.end()])
        pos = m.end()
    out.append(text[pos:])
    return [q for p in out if p for q in _pieces(p, max_chars, level + 1)]


def split_document(text, max_chars):
    """Split a source file into chunks of at most ~max_chars, preferring top-level boundaries;
    concatenating the chunks gives back the text exactly."""
    if not max_chars or len(text) <= max_chars:
        return [text]
    chunks, cur = [], ""
    for piece in _pieces(text, max_chars):
        if cur and len(cur) + len(piece) > max_chars:
            chunks.append(cur)
            cur = ""
        cur += piece
    if cur:
        chunks.append(cur)
    return chunks


def build_corpus(output, root=None, max_docs=None, max_bytes=None, min_chars=64, max_doc_chars=4000):
    """Write the corpus; returns (num_docs, num_bytes_of_text)."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source root {root!r} is not a directory")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    docs = nbytes = 0
    done = False
    with open(tmp, "w", encoding="utf-8") as out:
        for path in iter_source_files(root):
            if max_docs is not None and docs >= max_docs:
                break
            try:
                with open(path, "r", encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            rel = os.path.relpath(path, root)
            for part, chunk in enumerate(split_document(text, max_doc_chars)):
                if len(chunk.strip()) < min_chars:
                    continue
                if max_docs is not None and docs >= max_docs:
                    break
                size = len(chunk.encode("utf-8"))
                if max_bytes is not None and nbytes + size > max_bytes:
                    # skip chunks that do not fit; stop once nothing useful can fit any more
                    done = max_bytes - nbytes < min_chars
                    if done:
                        break
                    continue
                out.write(json.dumps({"text": chunk, "source": f"{rel}#{part}"}) + "\n")
                docs += 1
                nbytes += size
            if done:
                break
    os.replace(tmp, output)
    return docs, nbytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="output .jsonl path")
    p.add_argument("--root", default=None, help="source tree (default: Python stdlib directory)")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--max-bytes", type=int, default=None, help="stop before exceeding this many bytes of text")
    p.add_argument("--min-chars", type=int, default=64, help="skip documents with fewer characters")
    p.add_argument("--max-doc-chars", type=int, default=4000,
                   help="split files into documents of about this many characters at top-level "
                        "blank lines (0: one document per file)")
    args = p.parse_args(argv)
    docs, nbytes = build_corpus(args.output, args.root, args.max_docs, args.max_bytes, args.min_chars,
                                args.max_doc_chars)
    print(f"wrote {docs} documents, {nbytes / 1e6:.2f} MB of text to {args.output}", file=sys.stderr)
    if docs == 0:
        print("error: no documents written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
