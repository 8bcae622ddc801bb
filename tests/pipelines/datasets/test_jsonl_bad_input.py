"""Bad JSONL input at the reader: missing files, lone surrogates, duplicate lines and ids."""

import json

import pytest

from pipelines.datasets import DatasetError, DeadLetter, Duplicate, Example
from pipelines.datasets.custom_jsonl import read_custom_jsonl
from pipelines.datasets.gsm8k import read_gsm8k_jsonl
from pipelines.datasets.records import content_id, lone_surrogate


def _lines(path, *lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def test_missing_or_unreadable_file_is_one_dataset_error(tmp_path):
  with pytest.raises(DatasetError, match=r"^dataset file not found: .*nope\.jsonl$"):
    list(read_gsm8k_jsonl(str(tmp_path / "nope.jsonl")))
  with pytest.raises(DatasetError, match=r"^dataset path is a directory: .* \(name a file, or its "
                                         r"files with a pattern: .*/\*\.parquet\)$"):
    list(read_gsm8k_jsonl(str(tmp_path)))


def test_lone_surrogate_line_is_a_dead_letter_with_file_and_line(tmp_path):
  path = _lines(tmp_path / "s.jsonl",
                json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}),
                '{"question": "bad \\ud800 text", "answer": "#### 1"}',  # a JSON escape, valid JSON
                '{"question": "ok", "answer": "#### 2", "meta": {"\\udfff": 1}}',  # in a key
                json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}))
  out = list(read_gsm8k_jsonl(path))
  assert [type(r).__name__ for r in out] == ["Example", "DeadLetter", "DeadLetter", "Example"]
  assert (out[1].source, out[1].line_number) == (path, 2)
  assert out[1].reason == r"invalid JSON: lone surrogate '\ud800' in field 'question'"
  assert (out[2].line_number, out[2].reason) == (3, r"invalid JSON: lone surrogate '\udfff' in field 'meta'")
  # The custom reader would hash the text into the id: it gets the same dead letter instead of a crash.
  (dead,) = [r for r in read_custom_jsonl(path, {"question": "question", "answer": "answer"})
             if isinstance(r, DeadLetter)][:1]
  assert dead.line_number == 2


def test_lone_surrogate_finder():
  assert lone_surrogate({"a": ["x", {"b": "y\udc80"}]}) == ("a[1].b", "\udc80")
  assert lone_surrogate({"a": "ok", "é": ["ü", 1, None]}) is None
  # Content ids hash any text, even one that cannot be UTF-8, instead of raising.
  assert content_id("c", "q\ud800", "a") != content_id("c", "q", "a")


def test_duplicate_lines_are_skipped_and_reported(tmp_path):
  a = json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"})
  b = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
  # Same object with other key order and spacing: still the same line.
  a2 = json.dumps({"answer": "#### 5", "question": "What is 2 + 3?"}, indent=None, separators=(", ", ":"))
  path = _lines(tmp_path / "d.jsonl", a, b, a, a2, b)
  out = list(read_gsm8k_jsonl(path))
  examples = [r for r in out if isinstance(r, Example)]
  dups = [r for r in out if isinstance(r, Duplicate)]
  assert [e.id for e in examples] == ["gsm8k/test/0", "gsm8k/test/1"]  # the first of each is kept
  assert [(d.source, d.line_number, d.first_line_number) for d in dups] == [(path, 3, 1), (path, 4, 1), (path, 5, 2)]


def test_same_id_with_other_content_is_a_dead_letter(tmp_path):
  path = _lines(tmp_path / "ids.jsonl",
                json.dumps({"id": "x", "q": "What is 2 + 3?", "a": "5"}),
                json.dumps({"id": "x", "q": "What is 1 + 1?", "a": "2"}),
                json.dumps({"id": "y", "q": "What is 1 + 1?", "a": "2"}))
  out = list(read_custom_jsonl(path, {"question": "q", "answer": "a", "id": "id"}))
  assert [type(r).__name__ for r in out] == ["Example", "DeadLetter", "Example"]
  assert out[1].line_number == 2 and out[1].reason == "example id 'custom/x' is already used by line 1"


def test_gzip_that_cannot_be_read_to_its_end_is_one_dataset_error(tmp_path):
  # Before: zlib.error traceback for a .gz that is not gzip data; a truncated archive was
  # read up to the cut without a word (the rest of the dataset silently missing).
  fake = tmp_path / "plain.jsonl.gz"
  fake.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
  with pytest.raises(DatasetError, match=rf"^cannot read dataset file {fake}: Not a gzipped file"):
    list(read_gsm8k_jsonl(str(fake)))
  import gzip
  data = gzip.compress("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                               for i in range(2000)).encode())
  cut = tmp_path / "cut.jsonl.gz"
  cut.write_bytes(data[:len(data) // 2])
  with pytest.raises(DatasetError, match=rf"^cannot read dataset file {cut} after line \d+: "
                                         r"Compressed file ended before the end-of-stream marker"):
    list(read_gsm8k_jsonl(str(cut)))


@pytest.mark.parametrize("ext", [".bz2", ".xz", ".lzma", ".zst", ".deflate"])
def test_every_compression_cut_short_or_of_another_format_is_one_dataset_error(tmp_path, ext):
  """Only .gz was read to its end: a cut .bz2 or .xz dataset ran on the examples before the
  cut (a dead letter for the half line, the rest missing without a word; a cut inside the
  first block read as "dataset file is empty"). Streams one after another read whole."""
  import bz2
  import lzma
  import zlib

  import zstandard
  compress = {".bz2": bz2.compress, ".xz": lzma.compress, ".deflate": zlib.compress,
              ".lzma": lambda b: lzma.compress(b, format=lzma.FORMAT_ALONE),
              ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}[ext]
  data = compress("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                          for i in range(2000)).encode())
  whole, twice, cut, first_block, other = (tmp_path / f"{n}.jsonl{ext}" for n in
                                           ("whole", "twice", "cut", "first", "other"))
  whole.write_bytes(data)
  twice.write_bytes(data + data)
  cut.write_bytes(data[:len(data) * 2 // 3])
  first_block.write_bytes(data[:len(data) // 50])
  other.write_bytes(b'{"question": "q", "answer": "#### 1"}\n')
  assert len(list(read_gsm8k_jsonl(str(whole)))) == 2000
  assert len(list(read_gsm8k_jsonl(str(twice)))) == 4000  # (duplicates: skipped later)
  if ext == ".xz":  # (stream padding: zero bytes between and after streams, as xz allows)
    padded = tmp_path / "padded.jsonl.xz"
    padded.write_bytes(data + bytes(8) + data + bytes(1024))
    assert len(list(read_gsm8k_jsonl(str(padded)))) == 4000
  for path in (cut, first_block):
    with pytest.raises(DatasetError, match=rf"^cannot read dataset file {path}( after line \d+)?: "
                                           r"the compressed file ends inside a stream"):
      list(read_gsm8k_jsonl(str(path)))
  with pytest.raises(DatasetError, match=rf"^cannot read dataset file {other}: not "
                                         rf"{ext.lstrip('.')} data \("):
    list(read_gsm8k_jsonl(str(other)))


def test_json_nested_too_deeply_is_a_dead_letter(tmp_path):
  # Before: a RecursionError traceback from the json module ended the run.
  path = _lines(tmp_path / "deep.jsonl",
                '{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "#### 1"}',
                json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}))
  out = list(read_gsm8k_jsonl(path))
  assert [type(r).__name__ for r in out] == ["DeadLetter", "Example"]
  assert (out[0].line_number, out[0].reason) == (1, "invalid JSON: nested too deeply")


def test_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path):
  # Before: the first line of a file saved with a BOM was a dead letter ("Unexpected UTF-8 BOM").
  lines = [json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}),
           json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})]
  plain = _lines(tmp_path / "plain.jsonl", *lines)
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes())
  got = list(read_gsm8k_jsonl(str(bom)))
  assert all(isinstance(r, Example) for r in got) and len(got) == 2
  assert [r.id for r in got] == [r.id for r in read_gsm8k_jsonl(plain)]
  # A BOM anywhere else is not one: that line's text really starts with U+FEFF.
  (tmp_path / "mid.jsonl").write_bytes(b"\xef\xbb\xbf".join(l.encode() + b"\n" for l in lines[:1] * 2))
  assert isinstance(list(read_gsm8k_jsonl(str(tmp_path / "mid.jsonl")))[-1], DeadLetter)


def test_a_fifo_is_one_dataset_error_not_a_hang(tmp_path):
  # Before: opening the FIFO waited for a writer forever (and the job reads the dataset twice).
  import os
  fifo = tmp_path / "data.jsonl"
  os.mkfifo(fifo)
  with pytest.raises(DatasetError, match=rf"^dataset file is not a regular file: {fifo} \(a pipe"):
    list(read_gsm8k_jsonl(str(fifo)))


def test_gzip_data_under_a_plain_name_is_read(tmp_path):
  # Before: every line was a dead letter of invalid UTF-8.
  import gzip
  lines = [json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) for i in range(3)]
  packed = tmp_path / "data.jsonl"
  packed.write_bytes(gzip.compress("".join(l + "\n" for l in lines).encode()))
  got = list(read_gsm8k_jsonl(str(packed)))
  assert [r.reference for r in got] == ["1", "2", "3"]


def test_utf16_file_is_one_dataset_error_naming_the_encoding(tmp_path):
  # Before: every line a dead letter of invalid UTF-8 (the first) or invalid JSON (the rest).
  path = tmp_path / "u16.jsonl"
  path.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n", encoding="utf-16")
  with pytest.raises(DatasetError, match=rf"^dataset file is UTF-16, not UTF-8: {path} \("):
    list(read_gsm8k_jsonl(str(path)))


def test_an_integer_too_long_to_convert_is_a_dead_letter(tmp_path):
  # Before: json's ValueError (over 4300 digits) escaped the reader and stopped the run.
  path = _lines(tmp_path / "big.jsonl", '{"question": "q", "answer": "#### 1", "n": ' + "9" * 5000 + "}",
                json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}))
  out = list(read_gsm8k_jsonl(path))
  assert [type(r).__name__ for r in out] == ["DeadLetter", "Example"]
  assert out[0].line_number == 1 and out[0].reason.startswith("invalid JSON: Exceeds the limit")
