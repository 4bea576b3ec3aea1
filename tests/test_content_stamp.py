"""Content stamps (data/source_files.content_stamp, issue 44): a rule's input that stands for files' content, whose
time moves when a byte changes and never for a touch, whatever the files' size (Snakemake checksums only inputs
under 1 MB)."""
from __future__ import annotations

import os

from workflow_scripts.data import source_files


def test_a_stamp_moves_with_content_not_with_a_touch(tmp_path):
    cache, stamps = tmp_path / "cache.json", tmp_path / "stamps"
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (2**20 + 10))
    os.utime(big, (1_000_000, 1_000_000))
    stamp = tmp_path / source_files.content_stamp("d", [big], stamps, cache)
    # a new stamp takes the files' newest time: a finished run's outputs stay newer than their input
    assert stamp.stat().st_mtime == 1_000_000
    text = stamp.read_text()

    os.utime(big, (2_000_000, 2_000_000))  # touched: the same bytes
    source_files.content_stamp("d", [big], stamps, cache)
    assert stamp.stat().st_mtime == 1_000_000 and stamp.read_text() == text

    big.write_bytes(b"y" * (2**20 + 10))  # new bytes with the old time (cp -p)
    os.utime(big, (1_000_000, 1_000_000))
    source_files.content_stamp("d", [big], stamps, cache)
    assert stamp.read_text() != text and stamp.stat().st_mtime > 2_000_000
    assert not [p for p in stamps.iterdir() if p.name.endswith(".partial")]


def test_a_missing_file_is_stamped_as_missing(tmp_path):
    stamp = tmp_path / source_files.content_stamp("d", [tmp_path / "absent"], tmp_path / "s", tmp_path / "c.json")
    assert '"' + str(tmp_path / "absent") + '": null' in stamp.read_text()
