"""tools/plot_logs.py: JSONL and tensorboard logs become a PNG and a summary table."""

import json

import pytest

from tools import plot_logs


def _write_jsonl(path, losses, key="lm_loss"):
    """Records shaped like pretrain_gpt.py --jsonl-log: train and valid share the lm_loss key."""
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"type": "train", "iteration": i * 10, key: loss}) + "\n")
            f.write(json.dumps({"type": "valid", "iteration": i * 10, key: loss + 100.0}) + "\n")
        f.write(json.dumps({"type": "summary", "final_lm_loss": losses[-1]}) + "\n")


def test_jsonl_runs_plot_and_table(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_jsonl(a, [5.0, 4.0, 3.0])
    _write_jsonl(b, [5.0, 4.5, 3.3], key="lm loss")
    out = tmp_path / "plot" / "loss.png"
    assert plot_logs.main([f"base={a}", f"quant={b}", "--output", str(out)]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    runs = {"base": plot_logs.read_run(str(a), "lm loss"), "quant": plot_logs.read_run(str(b), "lm loss")}
    assert runs["base"] == [(10, 5.0), (20, 4.0), (30, 3.0)]
    table = plot_logs.summary_table(runs, "lm loss")
    assert "| quant | 30 | 3.3000 | +10.00% |" in table
    # validation records are kept apart from training records
    assert plot_logs.read_run(str(a), "validation loss") == [(10, 105.0), (20, 104.0), (30, 103.0)]


def test_tensorboard_run(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, value in [(1, 3.0), (2, 2.5)]:
        writer.add_scalar("lm loss", value, step)  # the trainer's tags
        writer.add_scalar("lm loss validation", value + 1, step)
    writer.close()
    assert plot_logs.read_run(str(tmp_path / "tb"), "lm loss") == [(1, 3.0), (2, 2.5)]
    assert plot_logs.read_run(str(tmp_path / "tb"), "validation loss") == [(1, 4.0), (2, 3.5)]


def test_bad_inputs_are_reported(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert plot_logs.main([f"x={missing}", "--output", str(tmp_path / "o.png")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "lm loss": 2.0}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        plot_logs.read_jsonl(str(bad), "lm loss")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"iteration": 1, "other": 1.0}\n')
    with pytest.raises(ValueError, match="no values"):
        plot_logs.read_run(str(empty), "lm loss")


def test_communication_table_puts_runs_side_by_side(tmp_path, capsys):
    """The quickstart's closing table: final losses and inter-node bits per element; the
    unquantized run shows what the quantized run reports the unquantized wire would carry."""
    base, quant = tmp_path / "base.jsonl", tmp_path / "quant.jsonl"
    _write_jsonl(base, [5.0, 4.0])
    _write_jsonl(quant, [5.0, 4.1])
    with open(base, "a") as f:  # a resumed run appends a second summary: the last one counts
        f.write(json.dumps({"type": "summary", "iterations": 20, "final_lm_loss": 4.0,
                            "final_val_loss": 4.2, "ms_per_iteration": 100.0}) + "\n")
    with open(quant, "a") as f:
        f.write(json.dumps({"type": "summary", "iterations": 20, "final_lm_loss": 4.1,
                            "final_val_loss": 4.3, "ms_per_iteration": 120.0,
                            "grad_inter_bits_per_element": 4.25,
                            "grad_inter_baseline_bits_per_element": 32.0,
                            "weight_inter_bits_per_element": 4.0156,
                            "weight_inter_baseline_bits_per_element": 16.0}) + "\n")
    assert plot_logs.main([f"baseline={base}", f"sdp4bit={quant}", "--output",
                           str(tmp_path / "loss.png")]) == 0
    out = capsys.readouterr().out
    assert "| baseline | 4.0000 | 4.2000 | 100.0 | 32.00 (unquantized) | 16.00 (unquantized) |" in out
    assert "| sdp4bit | 4.1000 | 4.3000 | 120.0 | 4.25 | 4.02 |" in out


def test_runs_with_the_same_file_name_keep_apart(tmp_path, capsys):
    """Two runs' metrics.jsonl without labels: both are plotted and tabled, labelled by their
    directories (the second replaced the first before, and the table said +0.00%); the same
    explicit label twice is an error; a resumed run's repeated iterations keep their last value."""
    (tmp_path / "base").mkdir()
    (tmp_path / "sdp").mkdir()
    a, b = tmp_path / "base" / "metrics.jsonl", tmp_path / "sdp" / "metrics.jsonl"
    _write_jsonl(a, [5.0, 4.0, 3.0])
    _write_jsonl(b, [5.0, 4.5, 3.3])
    assert plot_logs.run_labels([str(a), str(b), f"x={a}"]) == [
        ("base/metrics.jsonl", str(a)), ("sdp/metrics.jsonl", str(b)), ("x", str(a))]
    assert plot_logs.main([str(a), str(b), "--output", str(tmp_path / "o.png")]) == 0
    table = capsys.readouterr().out
    assert "| sdp/metrics.jsonl | 30 | 3.3000 | +10.00% |" in table
    assert plot_logs.main([f"r={a}", f"r={b}", "--output", str(tmp_path / "o.png")]) == 2
    assert "label(s) r given to more than one run" in capsys.readouterr().err
    with open(b, "a") as f:   # resumed from iteration 20: iteration 30 again, another value
        f.write(json.dumps({"type": "train", "iteration": 30, "lm_loss": 3.1}) + "\n")
    assert plot_logs.read_run(str(b), "lm loss") == [(10, 5.0), (20, 4.5), (30, 3.1)]
