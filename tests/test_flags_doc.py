"""docs/flags.md is generated from the parser and must match it."""

from megatron.training.arguments.parser import build_parser
from tools import generate_flags_doc


def test_flags_doc_is_current():
    with open(generate_flags_doc.DOC_PATH, encoding="utf-8") as f:
        on_disk = f.read()
    assert on_disk == generate_flags_doc.render(build_parser()), (
        "docs/flags.md is stale: run python tools/generate_flags_doc.py")


def test_every_quantization_flag_is_documented():
    text = generate_flags_doc.render(build_parser())
    for flag in ("--quantized-weights", "--quantized-gradients", "--quantized-grad-bits",
                 "--hadamard-transform", "--gq-group-size-inter", "--loco", "--grad-accum-dtype",
                 "--paro-strategy", "--device", "--dry-run"):
        assert f"`{flag}`" in text, flag
