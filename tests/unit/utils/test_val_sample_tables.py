"""Validation samples as a table in TensorBoard (markdown in the Text tab, read back from the event file)
and in wandb (an offline run's table file and history record), beside samples.jsonl."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from nemo_like.utils import Logger, LoggerConfig

COLUMNS = ["step", "task", "prompt", "completion", "reward", "ground_truth"]


def _cfg(tmp_path: Path, **kw) -> LoggerConfig:
    base = dict(log_dir=str(tmp_path / "logs"), stdout_enabled=False, tensorboard_enabled=False,
                num_val_samples_to_table=2)
    return LoggerConfig(**(base | kw))


def _rows() -> list[dict]:
    # Text a table cell must keep literal (a pipe, a newline, an HTML-like tag, markdown stars), an
    # unscorable sample (NaN reward), and a ground truth that is a number in one row and a list in another.
    return [{"task": "math", "prompt": "a | b\n2*3=", "completion": "<think>6</think> **6**", "reward": 1.0,
             "ground_truth": 6},
            {"task": "math", "prompt": "1+1=", "completion": "3", "reward": math.nan, "ground_truth": [2, "two"]},
            {"task": "math", "prompt": "not in the table", "completion": "x", "reward": 0.0, "ground_truth": 0}]


@pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")
def test_val_samples_go_to_tensorboard_as_a_markdown_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugin_util import markdown_to_safe_html

    # Neither samples.jsonl nor stdout wants them: TensorBoard alone asks for the validation's samples.
    with Logger(_cfg(tmp_path, tensorboard_enabled=True, log_val_samples=False)) as logger:
        assert logger.wants_samples("val") is None
        logger.log_metrics({"accuracy": 0.5}, step=4, prefix="val")
        logger.log_samples(_rows(), step=4, split="val")
        logger.log_samples(_rows(), step=5, split="train")  # training samples: no table
    acc = EventAccumulator(str(tmp_path / "logs" / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert acc.Tags()["tensors"] == ["val/samples/text_summary"]
    (event,) = acc.Tensors("val/samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(c.replace("_", "\\_") for c in COLUMNS) + " |"
    assert lines[2] == "| 4 | math | a \\| b<br>2\\*3= | &lt;think&gt;6&lt;/think&gt; \\*\\*6\\*\\* | 1 | 6 |"
    assert lines[3] == '| 4 | math | 1+1= | 3 |  | \\[2, "two"\\] |'  # NaN reward: an empty cell
    assert len(lines) == 4  # num_val_samples_to_table=2 rows
    # What the Text tab shows: one table, the cells' text literal.
    page = markdown_to_safe_html(text)
    assert page.count("<table>") == 1 and page.count("<tr>") == 3
    assert "<td>a | b<br>2*3=</td>" in page and "<td>&lt;think&gt;6&lt;/think&gt; **6**</td>" in page
    assert not (tmp_path / "logs" / "samples.jsonl").exists()


def test_val_samples_go_to_wandb_as_a_table_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, wandb_enabled=True, wandb={"project": "nemo_like_test", "name": "t", "mode": "offline"})
    logger = Logger(cfg)
    logger.log_metrics({"accuracy": 0.5}, step=3, prefix="val")
    logger.log_samples(_rows(), step=3, split="val")
    logger.close()
    assert wandb.run is None
    (run,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    (table_file,) = (run / "files" / "media" / "table" / "val").glob("samples_3_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == COLUMNS
    # The mixed ground-truth column as text (a wandb table refuses mixed types); NaN reward as null.
    assert table["data"] == [[3, "math", "a | b\n2*3=", "<think>6</think> **6**", 1.0, "6"],
                             [3, "math", "1+1=", "3", None, '[2, "two"]']]
    # The run's history row of step 3 holds it as a table under val/samples. wandb's service process
    # may still be writing the run file when finish() returns: wait for it.
    (record,) = run.glob("*.wandb")
    deadline = time.monotonic() + 60
    while b"val/samples" not in (raw := record.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"val/samples" in raw and b'"table-file"' in raw
    # samples.jsonl keeps every sample.
    assert len((tmp_path / "logs" / "samples.jsonl").read_text().splitlines()) == 3


def test_no_table_when_asked_for_none_or_no_table_logger(tmp_path):
    quiet = Logger(_cfg(tmp_path, tensorboard_enabled=True, log_val_samples=False, num_val_samples_to_table=0))
    assert quiet.wants_samples("val") == 0
    quiet.log_samples(_rows(), step=1, split="val")
    quiet.close()
    assert not (tmp_path / "logs" / "tensorboard").exists()
    files_only = Logger(_cfg(tmp_path, log_val_samples=False))  # no TensorBoard, no wandb
    assert files_only.wants_samples("val") == 0
    files_only.close()
