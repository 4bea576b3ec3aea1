"""Streaming plain-text corpora: reading line by line (gzip too) and building the normalised Arrow data."""
from __future__ import annotations

import gzip
import zlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import text_lines


def test_lines_of_many_files_plain_and_gzip(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufefffirst line\r\n\n   \nsecond\u2028same line\n".encode())
    with gzip.open(tmp_path / "b.txt.gz", "wb") as handle:
        handle.write("x\n\ny é\n".encode())
    (tmp_path / "c.txt").write_bytes(b"no newline at the end")
    counts = text_lines.LineCounts()
    paths = [tmp_path / "a.txt", tmp_path / "b.txt.gz", tmp_path / "c.txt"]
    lines = list(text_lines.iter_lines(paths, counts))
    assert [(Path(f).name, n, t) for f, n, t in lines] == [
        ("a.txt", 1, "first line"), ("a.txt", 4, "second\u2028same line"),  # BOM and \r gone; U+2028 kept
        ("b.txt.gz", 1, "x"), ("b.txt.gz", 3, "y é"), ("c.txt", 1, "no newline at the end"),
    ]
    assert counts.as_report()["files"][str(paths[0])] == {"lines": 4, "kept": 2, "blank": 2, "blank_lines": [2, 3],
                                                           "invalid_text": 0, "invalid_text_lines": []}
    assert counts.as_report()["files"][str(paths[1])]["blank_lines"] == [2]  # counted and named
    assert (counts.total("lines"), counts.total("kept"), counts.total("blank")) == (8, 5, 3)


def test_blank_lines_are_named_up_to_twenty_per_file(tmp_path):
    (tmp_path / "a.txt").write_text("text\n" + "\n" * 30 + "more\n")
    counts = text_lines.LineCounts()
    list(text_lines.iter_lines([tmp_path / "a.txt"], counts))
    entry = counts.as_report()["files"][str(tmp_path / "a.txt")]
    assert entry["blank"] == 30 and entry["blank_lines"] == list(range(2, 22))


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("fine\nalso fine\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(WorkflowError) as caught:
        list(text_lines.iter_lines([tmp_path / "latin1.txt"]))
    assert str(caught.value).endswith(  # no iconv: converting a UTF-8 file with one bad line would damage it
        "latin1.txt line 3: invalid UTF-8 at byte 3 of the line (unexpected end of data); fix or remove that line, "
        "or set the dataset's on_invalid_text: reject_row to reject and count such lines")


def test_invalid_utf8_lines_are_rejected_and_counted_under_reject_row(tmp_path):
    (tmp_path / "mixed.txt").write_bytes("fine\ncaf\u00e9\n\nalso fine\n".encode("utf-8") + b"caf\xe9\nend\n")
    counts = text_lines.LineCounts()
    lines = list(text_lines.iter_lines([tmp_path / "mixed.txt"], counts, on_invalid_text="reject_row"))
    assert [(n, t) for _, n, t in lines] == [(1, "fine"), (2, "caf\u00e9"), (4, "also fine"), (6, "end")]
    entry = counts.as_report()["files"][str(tmp_path / "mixed.txt")]
    assert (entry["invalid_text"], entry["invalid_text_lines"], entry["blank"], entry["kept"]) == (1, [5], 1, 4)
    assert text_lines.count_lines(tmp_path / "mixed.txt") == 5  # download counts it; normalise judges it


def test_damaged_gzip_and_name_clashes_are_refused(tmp_path):
    import random

    rng = random.Random(0)  # text that compresses poorly, so half the file holds thousands of lines
    text = "".join(f"{rng.getrandbits(64):x} line {i}\n" for i in range(20_000)).encode()
    data = gzip.compress(text)
    (tmp_path / "cut.txt.gz").write_bytes(data[: len(data) // 2])
    whole = len(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[: len(data) // 2]).split(b"\n")) - 1
    assert whole > 1000
    with pytest.raises(WorkflowError, match=f"cut.txt.gz: the gzip stream is damaged or cut short after line {whole}, "
                                            "the last line read whole"):  # not "line 1": the lines before it decode
        list(text_lines.iter_lines([tmp_path / "cut.txt.gz"]))
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    for folder in ("d1", "d2"):
        (tmp_path / folder / "part.txt").write_text("x\n")
    with pytest.raises(WorkflowError, match="same name stem 'part'"):
        list(text_lines.iter_lines([tmp_path / "d1/part.txt", tmp_path / "d2/part.txt"]))
    with pytest.raises(WorkflowError, match="no such file"):
        list(text_lines.iter_lines([tmp_path / "missing.txt"]))


def test_write_normalised_ids_report_and_nothing_left_on_failure(tmp_path):
    from datasets import load_from_disk

    (tmp_path / "train1.txt").write_text("alpha\n\nbeta\n")
    with gzip.open(tmp_path / "train2.txt.gz", "wt") as handle:
        handle.write("gamma\n")
    (tmp_path / "test.txt").write_text("delta\n")
    out = tmp_path / "normalised"
    report = text_lines.write_normalised(
        {"train": [tmp_path / "train1.txt", tmp_path / "train2.txt.gz"], "test": [tmp_path / "test.txt"]}, out)
    data = load_from_disk(str(out))
    assert data["train"][:] == {"id": ["train1-1", "train1-3", "train2-1"], "text": ["alpha", "beta", "gamma"]}
    assert data["test"][:] == {"id": ["test-1"], "text": ["delta"]}
    assert report["train"]["kept"] == 3 and report["train"]["blank"] == 1
    assert list(report["train"]["files"]) == [str(tmp_path / "train1.txt"), str(tmp_path / "train2.txt.gz")]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # work directory gone

    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(WorkflowError, match=r"bad\.txt line 2: invalid UTF-8"):
        text_lines.write_normalised({"train": [tmp_path / "bad.txt"]}, tmp_path / "other")
    assert not (tmp_path / "other").exists()
    # an evaluation-only corpus: held-out lines and no train split
    assert text_lines.write_normalised({"test": [tmp_path / "test.txt"]}, tmp_path / "other")["test"]["kept"] == 1
    assert list(load_from_disk(str(tmp_path / "other"))) == ["test"]


MEMORY_PROBE = textwrap.dedent("""
    import json, sys, threading, time
    def anonymous_bytes():  # private memory only: Arrow files mapped from disk are page cache, not heap
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    import datasets
    from workflow_scripts.data import text_lines
    datasets.disable_progress_bars()
    baseline = anonymous_bytes()
    peak, done = [baseline], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample)
    sampler.start()
    report = text_lines.write_normalised({"train": sys.argv[1:-1]}, sys.argv[-1])
    done.set()
    sampler.join()
    print(json.dumps({"kept": report["train"]["kept"], "growth": peak[0] - baseline}))
""")


def test_conversion_memory_stays_far_below_the_corpus_size(tmp_path):
    lines, width = 200_000, 1000
    filler = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * 20)[:width]

    def chunk(start: int) -> str:
        return "".join(f"{k} {filler}\n" for k in range(start, start + 10_000))

    with open(tmp_path / "part1.txt", "w") as handle:
        for start in range(0, lines // 2, 10_000):
            handle.write(chunk(start))
    with gzip.open(tmp_path / "part2.txt.gz", "wt", compresslevel=1) as handle:
        for start in range(lines // 2, lines, 10_000):
            handle.write(chunk(start))
    # The corpus as Python objects (one str per text and id) is what a list-based conversion holds.
    as_python = lines * (sys.getsizeof(f"{lines} {filler}") + sys.getsizeof(f"part1-{lines}"))
    assert as_python > 200e6
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "part1.txt"), str(tmp_path / "part2.txt.gz"),
         str(tmp_path / "normalised")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["kept"] == lines
    # Measured: ~50 MB (one writer batch of 10,000 rows plus Arrow buffers) against ~217 MB of objects.
    assert probe["growth"] < as_python / 2.5, probe
