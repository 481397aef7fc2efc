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
    from megatron.training.data.tokenizer import GPT2BPETokenizer as TrainerGPT2

    trainer_tok = TrainerGPT2(env["vocab"], env["merges"])  # what pretrain_gpt.py will use
    assert (trainer_tok.eod, trainer_tok.vocab_size) == (tok.eod, tok.vocab_size)
    for t in NONEMPTY:
        ids = tok.tokenize(t)
        assert ids == trainer_tok.tokenize(t)
        if "<|endoftext|>" not in t:  # HF maps a literal special token to its id, Megatron does not
            assert ids == ref(t, add_special_tokens=False)["input_ids"]
        assert tok.detokenize(ids) == t
    assert tok.eod not in tok.tokenize("a literal <|endoftext|> is plain text")


def test_several_json_keys_keep_their_documents_aligned(env, capsys):
    """With several --json-keys, document i of every output is record i (Megatron-LM writes an
    empty value as an empty document, without EOD); skipping it for one key only shifted that
    key's documents against the others'."""
    path = env["dir"] / "two_keys.jsonl"
    _write_jsonl(path, [{"a": "x y", "b": ""}, {"a": "z", "b": "w v"}, {"a": " ", "b": "q"}])
    prefix = env["dir"] / "two"
    assert _run(env, path, prefix, "--json-keys", "a", "b") == 0
    tok = env["tok"]
    a, _ = _read(f"{prefix}_a_document")
    b, _ = _read(f"{prefix}_b_document")
    assert a == [tok.tokenize("x y") + [tok.eod], tok.tokenize("z") + [tok.eod], []]
    assert b == [[], tok.tokenize("w v") + [tok.eod], tok.tokenize("q") + [tok.eod]]
    assert "wrote 1 empty document(s) for key 'b'" in capsys.readouterr().err


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


def _save_hf_gpt2(env, name: str) -> str:
    """The tests' GPT-2 vocabulary as a saved HF fast tokenizer directory (offline)."""
    from transformers import GPT2TokenizerFast

    try:
        hf = GPT2TokenizerFast(vocab=env["vocab"], merges=env["merges"])
    except TypeError:
        hf = GPT2TokenizerFast(vocab_file=env["vocab"], merges_file=env["merges"])
    hf_dir = str(env["dir"] / name)
    hf.save_pretrained(hf_dir)
    return hf_dir


def _save_hf_with_bos(env, name: str) -> str:
    """The tests' GPT-2 vocabulary as a HF fast tokenizer whose post-processor starts every
    sequence with a BOS, as Llama's does (its id: the vocab's "<|endoftext|>", 0; EOS another)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer.from_file(os.path.join(_save_hf_gpt2(env, name + "_base"), "tokenizer.json"))
    base.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<|endoftext|>",
                                 eos_token=env["tok"]._tok.id_to_token(1))
    path = str(env["dir"] / name)
    hf.save_pretrained(path)
    return path


def test_hf_tokenizer_frames_documents_as_megatron_lm(env):
    """Megatron-LM's HuggingFaceTokenizer tokenizes with the tokenizer's special tokens: a Llama
    tokenizer writes ``BOS doc EOD`` (this tool wrote ``doc EOD``: the model never saw a BOS at
    a document start, unlike Megatron-LM's data and HF inference). Long documents tokenized in
    pieces get the BOS once."""
    tok = pp.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=_save_hf_with_bos(env, "bos"))
    plain = tok.tokenize_text(TRICKY)
    assert plain[0] != 0 and tok.tokenize(TRICKY) == [0] + plain
    assert tok.document_affixes() == ([0], [])
    assert pp.chunking_unsafe_reason(tok) is None
    for n in (0, 64, 7):
        ids = pp.tokenize_document(tok, TRICKY, n, eod=tok.eod)
        assert ids.tolist() == [0] + plain + [tok.eod], n
    assert pp.tokenize_document(tok, "", 0, eod=tok.eod).tolist() == []   # empty stays empty


def test_hf_and_sentencepiece_tokenizers(env):
    hf_dir = _save_hf_gpt2(env, "hf_tok")
    t = pp.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert t.eod == env["tok"].eod and t.vocab_size == 400
    assert all(t.tokenize(x) == env["tok"].tokenize(x) for x in NONEMPTY if "<|endoftext|>" not in x)

    import sentencepiece as spm

    model_prefix = str(env["dir"] / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(NONEMPTY * 3), model_prefix=model_prefix,
                                   vocab_size=120, model_type="bpe", minloglevel=2)
    model = model_prefix + ".model"
    raw = spm.SentencePieceProcessor(model_file=model)
    assert (raw.get_piece_size(), raw.bos_id(), raw.eos_id(), raw.pad_id()) == (120, 1, 2, -1)
    # Megatron-LM's three SentencePiece types, each with its own vocabulary, EOD and framing
    gpt = pp.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert gpt.vocab_size == 120 and gpt.eod == 2 and gpt.tokenize("ab cd") == raw.encode("ab cd")
    llama = pp.build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    assert llama.vocab_size == 120 and llama.eod == 2
    assert llama.tokenize("ab cd") == [1] + raw.encode("ab cd")
    sp = pp.build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended (the model has <s> and </s>): EOD is <EOD>, 122
    assert sp.vocab_size == 125 and sp.eod == 122
    assert sp.tokenize("ab<EOD>cd</s>") == raw.encode("ab") + [122] + raw.encode("cd") + [2]
    assert sp.detokenize(sp.tokenize("ab<EOD>cd")) == "ab<EOD>cd"
    for tok_type, tok in (("SentencePieceTokenizer", sp), ("GPTSentencePieceTokenizer", gpt),
                          ("Llama2Tokenizer", llama)):
        prefix = env["dir"] / f"sp_out_{tok_type}"
        argv = ["--input", env["corpus"], "--output-prefix", str(prefix), "--tokenizer-type",
                tok_type, "--tokenizer-model", model, "--append-eod"]
        assert pp.main(argv) == 0
        docs, _ = _read(f"{prefix}_text_document")
        assert docs == [tok.tokenize(x) + [tok.eod] for x in NONEMPTY], tok_type
        assert max(max(d) for d in docs) < tok.vocab_size


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


def _refused_by_every_worker_count(env, capsys, path, prefix) -> list:
    """Preprocess ``path`` with 1 and 2 workers (one record per chunk): each run must exit 1 and
    leave no partial output; returns each run's stderr."""
    errors = []
    for workers in ("1", "2"):
        assert _run(env, path, prefix, "--workers", workers, "--chunk-size", "1") == 1
        errors.append(capsys.readouterr().err)
        assert not os.path.exists(f"{prefix}_text_document.bin")  # partial output removed
    return errors


def test_bad_utf8_reports_file_and_line(env, capsys):
    good = [t for t in NONEMPTY[:4]]
    lines = [json.dumps({"text": t}).encode() for t in good]
    lines.insert(2, b'{"text": "caf\xe9 au lait"}')  # latin-1 byte: line 3
    path = env["dir"] / "latin1.jsonl"
    _write_lines(path, lines)
    prefix = env["dir"] / "latin1"
    for err in _refused_by_every_worker_count(env, capsys, path, prefix):
        assert (f"error: {path}: line 3: not valid UTF-8 (byte 0xe9 at byte 14 of the line: "
                f"invalid continuation byte); fix it, or pass --skip-bad-records") in err, err


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
    # Megatron-LM's other preprocess flags: accepted with a note where the files are the same,
    # refused by name where they would differ (it wrote one document per sentence)
    notes = pp.get_args(base + ["--partitions", "4", "--keep-sequential-samples", "--lang",
                                "english", "--keep-newlines"]).legacy_notes
    assert [n.split(" ")[1] for n in notes] == ["--partitions", "--keep-newlines"]
    with pytest.raises(SystemExit) as e:
        pp.get_args(base + ["--split-sentences"])
    assert e.value.code == 2 and "--split-sentences is not supported" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Long documents tokenized in pieces (--tokenize-chunk-chars), peak RSS, tokenizer description,
# null text.
# --------------------------------------------------------------------------------------------

# Runs of spaces / newlines / tabs next to words, unicode (incl. non-ASCII whitespace that the
# GPT-2 regex and str.isspace treat differently), punctuation, contractions, digits.
TRICKY = (
    "Hello   world!!  It's   a test.\n\n\n    indented    code();\n\t\tTabs\t and\tmixed \t \n"
    "café naïve 東京の天気は晴れ 🎉🎉 emoji, punctuation... ?!?! ((x)) [y] {z} -- — “quotes” «fr»\n"
    "numbers 12345 6.02e23 0x1F, contractions we'll they've I'm 'tis don 't\r\n"
    "nbsp\u00a0here ideographic\u3000space line\u2028sep para\u2029sep \x1cfs\x1d nel\x85x \u200bzw "
    + " " * 200 + "after a long run of spaces" + "\n" * 150 + "after newlines " + "x" * 300
    + " end " + "  \n " * 30 + " a b c d e f g h i j k l m n o p " + "<|endoftext|> literal"
    + " trailing   "
)


@pytest.fixture(scope="module")
def tokenizers_under_test(env):
    """{type: (tokenizer, kwargs)} for every tokenizer type the tests build offline."""
    hf_dir = _save_hf_gpt2(env, "hf_tok_chunks")

    import sentencepiece as spm

    model_prefix = str(env["dir"] / "sp_chunks")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(NONEMPTY * 3), model_prefix=model_prefix,
                                   vocab_size=120, model_type="bpe", minloglevel=2)
    kwargs = {
        "GPT2BPETokenizer": dict(vocab_file=env["vocab"], merge_file=env["merges"]),
        "HuggingFaceTokenizer": dict(tokenizer_model=hf_dir),
        "SentencePieceTokenizer": dict(tokenizer_model=model_prefix + ".model"),
    }
    return {t: (pp.build_tokenizer(t, **kw), kw) for t, kw in kwargs.items()}


def _check_pieces(text, n):
    pieces = list(pp.iter_text_pieces(text, n))
    assert "".join(pieces) == text
    assert all(pieces)
    for a, b in zip(pieces, pieces[1:]):  # every cut: "non-space| non-space"
        assert b[0] == " " and not a[-1].isspace() and len(b) > 1 and not b[1].isspace()
    return pieces


def test_iter_text_pieces_cuts_only_between_words():
    assert _check_pieces("one two three four", 3) == ["one", " two", " three", " four"]
    assert _check_pieces("a  b", 1) == ["a  b"]  # two spaces: never cut inside a whitespace run
    assert _check_pieces("a \nb c", 1) == ["a \nb", " c"]
    assert _check_pieces("x" * 50 + " y", 10) == ["x" * 50, " y"]  # no cut point: longer piece
    assert _check_pieces("abc", 0) == ["abc"]
    pieces = _check_pieces(TRICKY, 64)
    assert len(pieces) > 10
    assert max(len(p) for p in pieces) <= 400  # only the 300-char "x" run exceeds 64 (+ its word)


@pytest.mark.parametrize("tok_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"])
def test_chunked_tokenization_equals_whole(tokenizers_under_test, tok_type):
    tok, _ = tokenizers_under_test[tok_type]
    reason = pp.chunking_unsafe_reason(tok)
    if tok_type == "SentencePieceTokenizer":
        assert reason and "SentencePiece" in reason  # documented fallback: tokenized whole
    else:
        assert reason is None, reason  # chunking really is exercised for BPE tokenizers
    whole = tok.tokenize(TRICKY)
    for n in (64, 7, 1):
        chunk_chars, _ = pp.effective_chunk_chars(tok, n)
        ids = pp.tokenize_document(tok, TRICKY, chunk_chars, eod=tok.eod)
        assert ids.tolist() == whole + [tok.eod], (tok_type, n)
        if reason is None:  # the pieces themselves, tokenized one by one, give the same ids
            pieces = _check_pieces(TRICKY, n)
            assert [i for p in pieces for i in tok.tokenize(p)] == whole
    for text in NONEMPTY:
        assert pp.tokenize_document(tok, text, 5).tolist() == tok.tokenize(text)


def test_chunked_tokenization_fuzz(tokenizers_under_test):
    """Random mixes of words, whitespace runs and unicode, cut at many chunk sizes."""
    import random

    rng = random.Random(0)
    atoms = ["a", "bc", "def", " ", "  ", "\n", "\n\n", "\t", " \n", ".", "!?", "'s", "'ll", "é",
             "東京", "🎉", "12", "3.4", "\u00a0", "\u3000", "\u2028", "\x85", "\x1c", "-", "(", ")",
             "<|endoftext|>"]
    for tok_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        tok, _ = tokenizers_under_test[tok_type]
        for _ in range(150):
            text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 60)))
            whole = tok.tokenize(text)
            for n in (1, 3, 8):
                assert [i for p in pp.iter_text_pieces(text, n) for i in tok.tokenize(p)] == whole, (
                    tok_type, n, text)


def test_unsafe_hf_tokenizer_is_not_chunked(env, tokenizers_under_test):
    """An added token that strips the space after it would change the tokens at a cut: such a
    tokenizer is tokenized whole, and the reason names the token."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers_under_test["HuggingFaceTokenizer"][1]["tokenizer_model"])
    hf.add_tokens([AddedToken("<sep>", rstrip=True)])
    path = str(env["dir"] / "hf_rstrip")
    hf.save_pretrained(path)
    tok = pp.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    text = "a<sep> b"
    assert [i for p in pp.iter_text_pieces(text, 1) for i in tok.tokenize(p)] != tok.tokenize(text)
    reason = pp.chunking_unsafe_reason(tok)
    assert reason and "'<sep>'" in reason
    assert pp.effective_chunk_chars(tok, 64) == (0, reason)
    chunk_chars, _ = pp.effective_chunk_chars(tok, 1)
    assert pp.tokenize_document(tok, text, chunk_chars).tolist() == tok.tokenize(text)


def test_tokenize_chunk_chars_output_byte_identical(env, capsys):
    path = env["dir"] / "long_docs.jsonl"
    _write_jsonl(path, [{"text": t} for t in [TRICKY, TRICKY * 3] + TEXTS])
    whole, chunked, chunked_w2 = (env["dir"] / n for n in ("cc_whole", "cc_16", "cc_16_w2"))
    assert _run(env, path, whole, "--tokenize-chunk-chars", "0") == 0
    assert "tokenize-chunk=off, documents tokenized whole (--tokenize-chunk-chars 0)" in capsys.readouterr().err
    assert _run(env, path, chunked, "--tokenize-chunk-chars", "16") == 0
    assert "tokenize-chunk=16 chars" in capsys.readouterr().err
    assert _run(env, path, chunked_w2, "--tokenize-chunk-chars", "16", "--workers", "2") == 0
    expected = _files(f"{whole}_text_document")
    assert _files(f"{chunked}_text_document") == expected
    assert _files(f"{chunked_w2}_text_document") == expected
    docs, _ = _read(f"{whole}_text_document")
    assert docs[0] == env["tok"].tokenize(TRICKY) + [env["tok"].eod]


def test_tokenize_chunk_chars_flag(env, capsys):
    base = ["--input", env["corpus"], "--output-prefix", str(env["dir"] / "f"),
            "--tokenizer-type", "GPT2BPETokenizer"]
    assert pp.get_args(base).tokenize_chunk_chars == pp.DEFAULT_TOKENIZE_CHUNK_CHARS == 1_000_000
    with pytest.raises(SystemExit):
        pp.get_args(base + ["--tokenize-chunk-chars", "-1"])
    assert "--tokenize-chunk-chars must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pp.get_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tokenize-chunk-chars N" in help_text and "(default: 1,000,000)" in help_text
    assert "SentencePieceTokenizer and other HF tokenizers always tokenize whole documents" in help_text


def test_summary_reports_peak_rss_and_readable_tokenizer(env, tokenizers_under_test, capsys):
    for workers in ("1", "2"):
        prefix = env["dir"] / f"rss_{workers}"
        argv = ["--input", env["corpus"], "--output-prefix", str(prefix), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", env["vocab"], "--merge-file", env["merges"],
                "--workers", workers]
        summary = pp.preprocess(pp.get_args(argv))
        err = capsys.readouterr().err
        assert summary["peak_rss_mb"] > 10
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"done: {summary['records']} records, ") and " MB/s), peak RSS " in last, last
        assert f"peak RSS {summary['peak_rss_mb']:.0f} MB" in last
        if workers == "2":
            assert "(largest worker " in last and summary["peak_rss_mb_workers"] > 10
        assert " object at 0x" not in err
        assert (f"tokenizer=GPT2BPETokenizer(vocab_file={env['vocab']}, merge_file={env['merges']}, "
                f"vocab_size=400, eod=0) ") in err
    hf, kw = tokenizers_under_test["HuggingFaceTokenizer"]
    assert pp.describe_tokenizer(hf) == f"HuggingFaceTokenizer(model={kw['tokenizer_model']}, vocab_size=400, eod=0)"
    sp, kw = tokenizers_under_test["SentencePieceTokenizer"]
    assert pp.describe_tokenizer(sp) == f"SentencePieceTokenizer(model={kw['tokenizer_model']}, vocab_size=125, eod=122)"


def test_a_bad_record_stops_the_worker_pool_without_terminate(env, capsys, monkeypatch):
    """A failed run closes the pool and lets the workers finish, never ``Pool.terminate()``:
    terminate kills a worker that may hold the result queue's lock mid-write, and CPython's pool
    thread then waits on it forever (in a loop of this run, 2 of ~770 runs hung)."""
    import multiprocessing
    import multiprocessing.pool

    def refuse(self):
        raise AssertionError("Pool.terminate() called on a bad record")

    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", refuse)
    path = env["dir"] / "bad_late.jsonl"
    lines = [json.dumps({"text": t}) for t in NONEMPTY * 4]
    lines.insert(len(lines) - 3, '{"text": null}')
    path.write_text("\n".join(lines) + "\n")
    prefix = env["dir"] / "bad_late"
    assert _run(env, path, prefix, "--workers", "2", "--chunk-size", "1") == 1
    assert f"line {len(lines) - 3}: value of 'text' is null" in capsys.readouterr().err
    assert not os.path.exists(f"{prefix}_text_document.bin")
    assert multiprocessing.active_children() == []  # the workers were joined, none left behind


def test_a_bad_record_stops_the_feed(env, capsys, monkeypatch):
    """After an early bad record the pool is given no more records: the run stops reading the
    input (a pipe's worth of queued chunks at most), it does not tokenize the rest first."""
    path = env["dir"] / "bad_early.jsonl"
    lines = [json.dumps({"text": NONEMPTY[i % len(NONEMPTY)]}) for i in range(20000)]
    lines[1] = '{"text": null}'
    path.write_text("\n".join(lines) + "\n")
    pulled = []
    real_iter_records = pp.iter_records

    def counting(*a, **kw):
        fmt, records = real_iter_records(*a, **kw)
        return fmt, (pulled.append(1) or r for r in records)

    monkeypatch.setattr(pp, "iter_records", counting)
    assert _run(env, path, env["dir"] / "bad_early", "--workers", "2", "--chunk-size", "1") == 1
    assert "line 2: value of 'text' is null" in capsys.readouterr().err
    assert 2 <= len(pulled) < 10000, len(pulled)


def test_null_or_non_string_text_is_a_bad_record(env, capsys):
    path = env["dir"] / "null_text.jsonl"
    path.write_text('{"text": "a b c"}\n{"text": null}\n{"text": "d e"}\n{"text": 7}\n')
    prefix = env["dir"] / "null_text"
    for err in _refused_by_every_worker_count(env, capsys, path, prefix):
        assert (f"error: {path}: line 2: value of 'text' is null, not a string; fix it, or pass "
                f"--skip-bad-records") in err, err
        assert "empty document" not in err
    summary = pp.preprocess(pp.get_args(
        ["--input", str(path), "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", env["vocab"], "--merge-file", env["merges"], "--skip-bad-records"]))
    assert summary["records"] == 2 and summary["bad_record_numbers"] == [2, 4]
    err = capsys.readouterr().err
    assert ("warning: skipped 2 bad record(s) (--skip-bad-records), at lines 2, 4; first: line 2: "
            "value of 'text' is null, not a string") in err
    assert "empty document" not in err
    docs, _ = _read(f"{prefix}_text_document")
    assert docs == [env["tok"].tokenize("a b c"), env["tok"].tokenize("d e")]
