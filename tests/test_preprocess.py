"""tools/preprocess_data.py, tools/train_tokenizer.py, tools/make_quickstart_corpus.py."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tools import make_quickstart_corpus, train_tokenizer
from tools import preprocess_data as pp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "",  # empty -> skipped
    "Unicode: café, naïve, 東京, emoji 🎉 and tabs\tand\n\nnewlines.",
    "class Foo:\n    pass\n\n\nprint(Foo())\n",
    "   \n\t ",  # whitespace only -> skipped
    "x = [i * i for i in range(10)]  # squares\n",
    "<|endoftext|> is the special token; it may appear in raw text too.",
] + [f"document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]
NONEMPTY = [t for t in TEXTS if t.strip()]


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    corpus = str(d / "corpus.jsonl")
    _write_jsonl(corpus, [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    vocab, merges, n = train_tokenizer.train(corpus, str(d / "tok"), vocab_size=400, min_frequency=1)
    assert n == 400
    tok = pp.build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    return dict(dir=d, corpus=corpus, vocab=vocab, merges=merges, tok=tok)


def _run(env, input_path, prefix, *extra):
    argv = ["--input", str(input_path), "--output-prefix", str(prefix),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", env["vocab"],
            "--merge-file", env["merges"], "--append-eod", "--log-interval", "10", *extra]
    return pp.main(argv)


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))], ds


def _files(prefix):
    return [open(f"{prefix}.{ext}", "rb").read() for ext in ("bin", "idx")]


def test_tokenizer_matches_reference(env):
    tok = env["tok"]
    assert tok.vocab_size == 400
    assert tok.eod == 0  # <|endoftext|> is the first (special) token of the trained vocab
    from transformers import GPT2TokenizerFast

    try:
        ref = GPT2TokenizerFast(vocab=env["vocab"], merges=env["merges"])  # transformers >= 5
    except TypeError:
        ref = GPT2TokenizerFast(vocab_file=env["vocab"], merges_file=env["merges"])
    from megatron.training.tokenizer import GPT2BPETokenizer as TrainerGPT2

    trainer_tok = TrainerGPT2(env["vocab"], env["merges"])  # what pretrain_gpt.py will use
    assert (trainer_tok.eod, trainer_tok.vocab_size) == (tok.eod, tok.vocab_size)
    for t in NONEMPTY:
        ids = tok.tokenize(t)
        assert ids == trainer_tok.tokenize(t)
        if "<|endoftext|>" not in t:  # HF maps a literal special token to its id, Megatron does not
            assert ids == ref(t, add_special_tokens=False)["input_ids"]
        assert tok.detokenize(ids) == t
    assert tok.eod not in tok.tokenize("a literal <|endoftext|> is plain text")


def test_jsonl_roundtrip(env, capsys):
    prefix = env["dir"] / "rt"
    assert _run(env, env["corpus"], prefix) == 0
    docs, ds = _read(f"{prefix}_text_document")
    tok = env["tok"]
    assert len(docs) == len(NONEMPTY)
    for text, ids in zip(NONEMPTY, docs):
        assert ids == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(ids[:-1]) == text
    assert ds.index.dtype == np.uint16  # vocab 400 < 65500
    assert len(ds.document_indices) == len(NONEMPTY) + 1
    err = capsys.readouterr().err
    assert "skipped 2 empty document(s)" in err
    assert "lines 3, 6" in err  # 1-based line numbers of the empty records
    assert "docs/s" in err and "MB/s" in err  # progress report (log interval 10)


def test_no_eod_and_multiple_keys(env):
    path = env["dir"] / "two_keys.jsonl"
    _write_jsonl(path, [{"text": t, "title": f"title {i}"} for i, t in enumerate(NONEMPTY[:5])])
    prefix = env["dir"] / "keys"
    argv = ["--input", str(path), "--output-prefix", str(prefix), "--columns", "text", "title",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", env["vocab"], "--merge-file", env["merges"]]
    assert pp.main(argv) == 0
    tok = env["tok"]
    texts, _ = _read(f"{prefix}_text_document")
    titles, _ = _read(f"{prefix}_title_document")
    assert texts == [tok.tokenize(t) for t in NONEMPTY[:5]]  # no EOD without --append-eod
    assert titles == [tok.tokenize(f"title {i}") for i in range(5)]


def test_workers_identical(env):
    a, b = env["dir"] / "w1", env["dir"] / "w2"
    assert _run(env, env["corpus"], a, "--workers", "1") == 0
    assert _run(env, env["corpus"], b, "--workers", "2", "--chunk-size", "3") == 0
    assert _files(f"{a}_text_document") == _files(f"{b}_text_document")


def test_hf_datasets_dir_and_parquet(env):
    import datasets

    base = env["dir"] / "base"
    assert _run(env, env["corpus"], base) == 0
    expected = _files(f"{base}_text_document")

    ds = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))})
    ds.save_to_disk(str(env["dir"] / "hf_ds"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(3))}).save_to_disk(str(env["dir"] / "hf_dd"))
    ds.to_parquet(str(env["dir"] / "data.parquet"))

    for name in ("hf_ds", "hf_dd", "data.parquet"):
        prefix = env["dir"] / f"out_{name.replace('.', '_')}"
        assert _run(env, env["dir"] / name, prefix, "--workers", "2") == 0, name
        assert _files(f"{prefix}_text_document") == expected, name

    # a missing column is reported by name
    prefix = env["dir"] / "bad_col"
    assert _run(env, env["dir"] / "data.parquet", prefix, "--json-keys", "body") == 1
    assert _run(env, env["dir"] / "hf_dd", prefix, "--json-keys", "body") == 1


def test_missing_key_reports_line(env, capsys):
    path = env["dir"] / "missing.jsonl"
    _write_jsonl(path, [{"text": "a b c"}, {"text": "d e f"}, {"content": "oops"}, {"text": "g"}])
    prefix = env["dir"] / "missing"
    assert _run(env, path, prefix, "--workers", "2", "--chunk-size", "1") == 1
    err = capsys.readouterr().err
    assert "line 3" in err and "'text'" in err and "content" in err
    assert not os.path.exists(f"{prefix}_text_document.bin")  # partial output removed
    assert not os.path.exists(f"{prefix}_text_document.idx")


def test_bad_json_and_unreadable_input(env, capsys):
    path = env["dir"] / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    assert _run(env, path, env["dir"] / "bad") == 1
    assert "line 2: invalid JSON" in capsys.readouterr().err
    assert _run(env, env["dir"] / "does_not_exist.jsonl", env["dir"] / "x") == 1
    assert "does not exist" in capsys.readouterr().err
    (env["dir"] / "plain_dir").mkdir()
    assert _run(env, env["dir"] / "plain_dir", env["dir"] / "x") == 1
    assert "save_to_disk" in capsys.readouterr().err


def test_missing_tokenizer_files(env, capsys):
    with pytest.raises(pp.PreprocessError, match="--merge-file"):
        pp.build_tokenizer("GPT2BPETokenizer", vocab_file=env["vocab"])
    with pytest.raises(pp.PreprocessError, match="nope.json"):
        pp.build_tokenizer("GPT2BPETokenizer", vocab_file="nope.json", merge_file=env["merges"])
    argv = ["--input", env["corpus"], "--output-prefix", str(env["dir"] / "y"),
            "--tokenizer-type", "SentencePieceTokenizer"]
    assert pp.main(argv) == 1
    assert "--tokenizer-model" in capsys.readouterr().err


def test_hf_and_sentencepiece_tokenizers(env):
    from transformers import GPT2TokenizerFast

    try:
        hf = GPT2TokenizerFast(vocab=env["vocab"], merges=env["merges"])
    except TypeError:
        hf = GPT2TokenizerFast(vocab_file=env["vocab"], merges_file=env["merges"])
    hf_dir = str(env["dir"] / "hf_tok")
    hf.save_pretrained(hf_dir)
    t = pp.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert t.eod == env["tok"].eod and t.vocab_size == 400
    assert all(t.tokenize(x) == env["tok"].tokenize(x) for x in NONEMPTY if "<|endoftext|>" not in x)

    import sentencepiece as spm

    model_prefix = str(env["dir"] / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(NONEMPTY * 3), model_prefix=model_prefix,
                                   vocab_size=120, model_type="bpe", minloglevel=2)
    prefix = env["dir"] / "sp_out"
    argv = ["--input", env["corpus"], "--output-prefix", str(prefix), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", model_prefix + ".model", "--append-eod"]
    assert pp.main(argv) == 0
    sp = pp.build_tokenizer("SentencePieceTokenizer", tokenizer_model=model_prefix + ".model")
    assert sp.vocab_size == 120 and sp.eod == 2
    docs, _ = _read(f"{prefix}_text_document")
    assert docs == [sp.tokenize(x) + [sp.eod] for x in NONEMPTY]


def test_import_has_no_side_effects():
    code = ("import sys; import tools.preprocess_data as m; "
            "assert callable(m.build_tokenizer); "
            "heavy = [k for k in ('torch', 'megatron.core', 'transformers', 'datasets') if k in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_quickstart_corpus_deterministic_and_capped(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    docs, nbytes = make_quickstart_corpus.build_corpus(a, max_bytes=300_000)
    assert docs > 20 and 250_000 < nbytes <= 300_000
    make_quickstart_corpus.build_corpus(b, max_bytes=300_000)
    assert open(a, "rb").read() == open(b, "rb").read()
    recs = [json.loads(line) for line in open(a)]
    assert len(recs) == docs and all(r["text"].strip() for r in recs)
    assert sum(len(r["text"].encode()) for r in recs) == nbytes
    assert max(len(r["text"]) for r in recs) <= 4000  # default --max-doc-chars
    docs, _ = make_quickstart_corpus.build_corpus(b, max_docs=7)
    assert docs == 7 and len(open(b).readlines()) == 7


def test_split_document_preserves_text():
    text = "import os\n\n\ndef f():\n    x = 1\n\n    return x\n\n\nclass A:\n    pass\n" * 50
    chunks = make_quickstart_corpus.split_document(text, 200)
    assert "".join(chunks) == text and len(chunks) > 10
    assert all(c.startswith(("import", "def", "class")) for c in chunks)


def _write_lines(path, lines):
    with open(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))


def test_bad_utf8_reports_file_and_line(env, capsys):
    good = [t for t in NONEMPTY[:4]]
    lines = [json.dumps({"text": t}).encode() for t in good]
    lines.insert(2, b'{"text": "caf\xe9 au lait"}')  # latin-1 byte: line 3
    path = env["dir"] / "latin1.jsonl"
    _write_lines(path, lines)
    prefix = env["dir"] / "latin1"
    for workers in ("1", "2"):
        assert _run(env, path, prefix, "--workers", workers, "--chunk-size", "1") == 1
        err = capsys.readouterr().err
        assert (f"error: {path}: line 3: not valid UTF-8 (byte 0xe9 at byte 14 of the line: "
                f"invalid continuation byte); fix it, or pass --skip-bad-records") in err, err
        assert not os.path.exists(f"{prefix}_text_document.bin")  # partial output removed


def test_skip_bad_records_writes_the_good_ones(env, capsys):
    good = NONEMPTY[:6]
    lines = [json.dumps({"text": t}).encode() for t in good]
    lines.insert(1, b'{"text": "\xff\xfe bad bytes"}')  # line 2
    lines.insert(4, b'{"text": broken json')  # line 5
    lines.insert(6, b'["not", "an", "object"]')  # line 7
    path = env["dir"] / "mixed.jsonl"
    _write_lines(path, lines)
    tok = env["tok"]
    for workers in ("1", "2"):
        prefix = env["dir"] / f"skipped_{workers}"
        argv = ["--input", str(path), "--output-prefix", str(prefix), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", env["vocab"], "--merge-file", env["merges"],
                "--append-eod", "--skip-bad-records", "--workers", workers, "--chunk-size", "2"]
        summary = pp.preprocess(pp.get_args(argv))
        docs, _ = _read(f"{prefix}_text_document")
        assert docs == [tok.tokenize(t) + [tok.eod] for t in good]
        assert summary["records"] == len(good)
        assert summary["bad_records_skipped"] == 3
        assert summary["bad_record_numbers"] == [2, 5, 7]
        err = capsys.readouterr().err
        assert ("warning: skipped 3 bad record(s) (--skip-bad-records), at lines 2, 5, 7; first: "
                "line 2: not valid UTF-8 (byte 0xff at byte 11 of the line: invalid start byte)") in err


def test_skip_bad_records_still_fails_when_every_record_is_bad(env, capsys):
    path = env["dir"] / "all_bad.jsonl"
    _write_lines(path, [b'{"body": "wrong key"}', b'{"body": "again"}'])
    prefix = env["dir"] / "all_bad"
    assert _run(env, path, prefix, "--skip-bad-records") == 1
    err = capsys.readouterr().err
    assert f"error: {path}: all 2 records are bad, e.g. line 1: record has no key 'text'" in err
    assert not os.path.exists(f"{prefix}_text_document.bin")


def test_bad_parquet_record_is_numbered(env, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = env["dir"] / "ints.parquet"  # typed columns: a bad column makes every record bad
    pq.write_table(pa.table({"text": ["a b c", "d e", "f g"], "n": [1, 2, 3]}), str(path))
    assert _run(env, path, env["dir"] / "ints", "--json-keys", "n") == 1
    assert "record 1: value of 'n' is int, not a string" in capsys.readouterr().err
    assert _run(env, path, env["dir"] / "ints", "--json-keys", "n", "--skip-bad-records") == 1
    assert ("all 3 records are bad, e.g. record 1: value of 'n' is int, not a string"
            in capsys.readouterr().err)


SDP4BIT_README_COMMAND = (
    "python tools/preprocess_data.py --input pile.jsonl --split train --columns text "
    "--output-prefix pile --vocab-file vocab.json --merge-file merges.txt --dataset-impl mmap "
    "--tokenizer-type GPT2BPETokenizer --append-eod --torch-backend mpi")


def test_sdp4bit_readme_command_verbatim(env, tmp_path):
    """The SDP4Bit reference README's command runs as written (only the interpreter and the
    script's location are made absolute; every flag and relative path is verbatim)."""
    shutil.copy(env["vocab"], tmp_path / "vocab.json")
    shutil.copy(env["merges"], tmp_path / "merges.txt")
    _write_jsonl(tmp_path / "pile.jsonl", [{"text": t, "meta": {"pile_set_name": "x"}} for t in TEXTS])
    argv = shlex.split(SDP4BIT_README_COMMAND)
    assert argv[:2] == ["python", "tools/preprocess_data.py"]
    argv[:2] = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py")]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 2, r.stderr  # one line per legacy flag, printed once
    assert notes[0].startswith("note: --dataset-impl mmap is the only format")
    assert notes[1].startswith("note: --torch-backend mpi is ignored")
    assert "--split" not in r.stderr  # train is the only split of a single file: nothing to say
    assert sorted(p.name for p in tmp_path.glob("pile_*")) == ["pile_text_document.bin",
                                                               "pile_text_document.idx"]
    docs, _ = _read(tmp_path / "pile_text_document")
    tok = env["tok"]
    assert docs == [tok.tokenize(t) + [tok.eod] for t in NONEMPTY]  # --columns text, --append-eod


def test_legacy_flags_refuse_or_note(env, capsys):
    base = ["--input", env["corpus"], "--output-prefix", str(env["dir"] / "legacy"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", env["vocab"], "--merge-file", env["merges"]]
    for impl in ("lazy", "cached"):  # the other old formats are not written: refuse, naming the flag
        with pytest.raises(SystemExit) as e:
            pp.get_args(base + ["--dataset-impl", impl])
        assert e.value.code == 2
        assert f"--dataset-impl {impl}: only the mmap format" in capsys.readouterr().err
    assert pp.get_args(base).legacy_notes == []  # no legacy flag, no note
    args = pp.get_args(base + ["--torch-backend", "gloo", "--split", "validation"])
    assert [n.split(" is ")[0] for n in args.legacy_notes] == ["note: --torch-backend gloo"]
    pp.preprocess(args)
    err = capsys.readouterr().err
    assert err.count("note: --torch-backend gloo is ignored") == 1
    assert "note: --split validation is ignored: a jsonl file has one split" in err
