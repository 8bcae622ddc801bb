"""Dataset files in the formats researchers bring: JSON Lines, a JSON array, Parquet (the
Hugging Face Hub's), CSV/TSV. Each record reads as the same JSONL line would."""

import dataclasses
import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.datasets import DatasetError, DeadLetter, Duplicate, Example
from pipelines.datasets.jsonl import iter_records
from pipelines.datasets.custom_jsonl import read_custom_jsonl
from pipelines.datasets.gsm8k import read_gsm8k_jsonl
from pipelines.datasets.humaneval import humaneval_examples, load_humaneval
from pipelines.datasets.jsonl import dataset_format

GSM = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
       {"question": "What is 7 - 1?", "answer": "7 - 1 = 6\n#### 6"},
       {"question": "What is 4 * 2?", "answer": "4 * 2 = 8\n#### 8"}]


def _write(path, fmt, records):
  if fmt == "jsonl":
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
  elif fmt == "json":
    path.write_text(json.dumps(records, indent=2))
  elif fmt == "parquet":
    pq.write_table(pa.Table.from_pylist(records), path)
  elif fmt == "csv":
    fields = list(records[0])
    import csv
    with open(path, "w", newline="") as f:
      w = csv.DictWriter(f, fields)
      w.writeheader()
      w.writerows(records)
  return str(path)


@pytest.mark.parametrize("fmt,name", [("json", "d.json"), ("parquet", "d.parquet"),
                                      ("csv", "d.csv"), ("parquet", "data-no-extension")])
def test_each_format_gives_the_jsonl_examples(tmp_path, fmt, name):
  jsonl = _write(tmp_path / "d.jsonl", "jsonl", GSM)
  other = _write(tmp_path / name, fmt, GSM)
  assert dataset_format(other) == fmt and dataset_format(jsonl) == "jsonl"
  want = list(read_gsm8k_jsonl(jsonl))
  got = list(read_gsm8k_jsonl(other))
  assert all(isinstance(e, Example) for e in got) and len(got) == 3
  if fmt == "csv":  # a CSV row is numbered by its first line after the header (was: the
    # header counted, the first id 1); each row spans two (the answer holds a newline)
    assert [e.id for e in got] == ["gsm8k/test/0", "gsm8k/test/2", "gsm8k/test/4"]
    got = [dataclasses.replace(e, id=w.id) for e, w in zip(got, want)]
  assert got == want  # ids (gsm8k/test/<record - 1>), questions, references, metadata


def test_bad_records_are_dead_letters_numbered_by_record(tmp_path):
  rows = [GSM[0], {"question": None, "answer": "#### 1"}, GSM[1], GSM[0]]
  for fmt in ("json", "parquet"):
    got = list(read_gsm8k_jsonl(_write(tmp_path / f"d.{fmt}", fmt, rows)))
    assert [type(r) for r in got] == [Example, DeadLetter, Example, Duplicate], fmt
    assert got[1].line_number == 2 and "'question' must be a string, got NoneType" in got[1].reason
    assert (got[3].line_number, got[3].first_line_number) == (4, 1)
    json.dumps(got[1].raw)  # written to dead_letters.jsonl as text


def test_json_array_elements_that_are_not_objects_or_not_utf8(tmp_path):
  path = tmp_path / "d.json"
  path.write_bytes(b'[{"question": "caf\xe9?", "answer": "#### 1"}, 5, ' + json.dumps(GSM[0]).encode()
                   + b', {"question": "\\ud800", "answer": "#### 2"}]')
  got = list(read_gsm8k_jsonl(str(path)))
  assert [type(r) for r in got] == [DeadLetter, DeadLetter, Example, DeadLetter]
  assert got[0].reason == "invalid UTF-8 (byte 0xe9) in field 'question'"
  assert got[1].reason == "expected a JSON object, got int"
  assert got[2].id == "gsm8k/test/2"
  assert got[3].reason.startswith("invalid JSON: lone surrogate")
  for d in (got[0], got[3]):
    d.raw.encode("utf-8")  # the raw text of a dead letter can be written


def test_a_json_array_that_does_not_parse_is_one_error_naming_the_place(tmp_path):
  path = tmp_path / "d.json"
  path.write_text('[\n  {"question": "q", "answer": "#### 1"},\n  {"question": \n')
  with pytest.raises(DatasetError) as e:
    list(read_gsm8k_jsonl(str(path)))
  assert str(e.value).startswith(f"dataset file {path} is a JSON array that does not parse: ")
  assert "(line 4 column 1)" in str(e.value)


def test_jsonl_whose_first_line_is_an_array_stays_jsonl(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text("[1, 2]\n" + json.dumps(GSM[0]) + "\n")
  got = list(read_gsm8k_jsonl(str(path)))
  assert isinstance(got[0], DeadLetter) and got[0].reason == "expected a JSON object, got list"
  assert isinstance(got[1], Example) and got[1].id == "gsm8k/test/1"
  # A first line nested too deeply to decode ended the run ("a JSON array that does not
  # parse"): a dead letter, and the next line runs; a deep array file stays one error.
  deep = "[" * 100000 + "]" * 100000
  path.write_text(deep + "\n" + json.dumps(GSM[0]) + "\n")
  got = list(read_gsm8k_jsonl(str(path)))
  assert got[0].reason == "invalid JSON: nested too deeply" and isinstance(got[1], Example)
  array = tmp_path / "deep.json"
  array.write_text("[\n" + deep + "\n]\n")
  with pytest.raises(DatasetError, match=r"is a JSON array that does not parse"):
    list(read_gsm8k_jsonl(str(array)))


def test_parquet_cells_become_json_values(tmp_path):
  import datetime
  path = tmp_path / "d.parquet"
  table = pa.table({"question": ["q?"], "answer": ["#### 3"], "blob": [b"bytes"],
                    "when": [datetime.date(2024, 1, 2)], "tags": [["a", "b"]],
                    "meta": [{"level": 2}]})
  pq.write_table(table, path)
  (ex,) = read_gsm8k_jsonl(str(path))
  assert ex.metadata["blob"] == "bytes" and ex.metadata["when"] == "2024-01-02"
  assert ex.metadata["tags"] == ["a", "b"] and ex.metadata["meta"] == {"level": 2}
  json.dumps(ex.to_dict())  # crosses process boundaries as JSON


def test_a_parquet_cell_that_is_not_utf8_is_a_dead_letter(tmp_path):
  # Before: decoded with replacement characters ('��') and run as a question.
  path = tmp_path / "d.parquet"
  pq.write_table(pa.table({"question": [b"\xff\xfe", b"q?"], "answer": ["#### 3", "#### 4"]}),
                 path)
  out = list(iter_records(str(path)))
  assert isinstance(out[0], DeadLetter) and out[0].line_number == 1
  assert out[0].reason == "invalid UTF-8 (byte 0xff) in field 'question'"
  assert not isinstance(out[1], DeadLetter) and out[1].obj["question"] == "q?"


def test_a_damaged_parquet_file_is_one_dataset_error(tmp_path):
  path = tmp_path / "d.parquet"
  _write(path, "parquet", GSM)
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(DatasetError, match=rf"^cannot read dataset file {path} as Parquet: "):
    list(read_gsm8k_jsonl(str(path)))


@pytest.mark.parametrize("content, hint", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab12\nsize 419088\n",
     " (a Git LFS pointer: fetch the file itself, e.g. git lfs pull)"),
    (b"<!DOCTYPE html>\n<html><body>Not found</body></html>\n",
     " (an HTML or XML page, e.g. a download's error page)"),
    (b'{"question": "q", "answer": "#### 1"}\n', "")])
def test_a_file_named_parquet_that_is_not_parquet_is_one_dataset_error(tmp_path, content, hint):
  # Before: read as JSON Lines: a Hub repo cloned without git-lfs lost a shard's rows to
  # dead letters (exit 0 over the other shards), or its one file said "invalid JSON".
  path = tmp_path / "test-00001-of-00002.parquet"
  path.write_bytes(content)
  with pytest.raises(DatasetError, match=rf"^cannot read dataset file {path} as Parquet: it does "
                                         rf"not start with PAR1{re.escape(hint)}$"):
    list(read_gsm8k_jsonl(str(path)))
  gz = tmp_path / "d.parquet.gz"
  gz.write_bytes(gzip.compress(content))
  with pytest.raises(DatasetError, match=r"as Parquet: it does not start with PAR1"):
    list(read_gsm8k_jsonl(str(gz)))


def test_csv_rows_with_quoted_commas_newlines_and_wrong_cell_counts(tmp_path):
  path = tmp_path / "d.csv"
  path.write_bytes(b'\xef\xbb\xbfprompt,target\r\n"What is, 2+2?",4\r\n"two\nlines",5\r\n'
                   b'only one cell\r\n\r\n"caf\xe9",6\r\n7+1,8\r\n')
  got = list(read_custom_jsonl(str(path), {"question": "prompt", "answer": "target"}))
  assert [type(r) for r in got] == [Example, Example, DeadLetter, DeadLetter, Example]
  assert [e.question for e in got if isinstance(e, Example)] == ["What is, 2+2?", "two\nlines", "7+1"]
  assert (got[2].line_number, got[2].reason) == (5, "1 cells where the header has 2")
  assert (got[3].line_number, got[3].reason) == (7, "invalid UTF-8 (byte 0xe9) in field 'prompt'")
  assert (got[2].raw, got[3].raw) == ("only one cell", '"caf\\xe9",6')


def test_a_csv_dead_letter_keeps_its_lines_as_written(tmp_path):
  # Before: the cells joined again, their quotes lost ("bad,row,1,extra": 4 cells to read).
  path = tmp_path / "d.csv"
  path.write_text('prompt,target\n"bad,row",1,extra\n"two\nlines",2,3\n')
  got = list(read_custom_jsonl(str(path), {"question": "prompt", "answer": "target"}))
  assert [(d.line_number, d.raw) for d in got] == [(2, '"bad,row",1,extra'),
                                                   (3, '"two\nlines",2,3')]


def test_tsv_and_compressed_csv(tmp_path):
  tsv = tmp_path / "d.tsv"
  tsv.write_text("question\tanswer\nWhat is 1, 2 or 3?\t3\n")
  (ex,) = read_custom_jsonl(str(tsv), {})
  assert (ex.question, ex.reference) == ("What is 1, 2 or 3?", "3")
  gz = tmp_path / "d.csv.gz"
  gz.write_bytes(gzip.compress(b"question,answer\nq?,7\n"))
  assert dataset_format(str(gz)) == "csv"
  (ex,) = read_custom_jsonl(str(gz), {})
  assert ex.reference == "7"


@pytest.mark.parametrize("header,message", [
    (",,\n", "has an empty header row (line 1)"),
    ("question,answer,question\n", "the header row names 'question' twice")])
def test_a_csv_header_that_names_no_fields_or_one_twice_is_one_error(tmp_path, header, message):
  path = tmp_path / "d.csv"
  path.write_text(header + "a,b,c\n")
  with pytest.raises(DatasetError, match=re.escape(message)):
    list(read_custom_jsonl(str(path), {}))


def test_humaneval_from_the_hubs_parquet_equals_the_packaged_problems(tmp_path):
  problems = humaneval_examples()[:5]
  rows = [{"task_id": e.id, "prompt": e.question, "canonical_solution": e.reference,
           "test": e.metadata["test"], "entry_point": e.metadata["entry_point"]} for e in problems]
  path = _write(tmp_path / "test-00000-of-00001.parquet", "parquet", rows)
  assert list(load_humaneval(path)) == problems


def test_a_csv_quote_that_is_not_closed_is_a_dead_letter_not_a_merged_row(tmp_path):
  # Before (a lenient reader): the row took the next one into its question, exit 0.
  path = tmp_path / "d.csv"
  path.write_text('question,answer\n"What is 2+2?",4\n"What is 3+3?,6\n"What is 4+4?",8\n'
                  '"What is 5+5?",10\n')
  got = list(read_custom_jsonl(str(path), {}))
  assert [type(r) for r in got] == [Example, DeadLetter, Example]
  assert [e.question for e in got if isinstance(e, Example)] == ["What is 2+2?", "What is 5+5?"]
  assert got[1].line_number == 3 and got[1].reason.startswith("not CSV: ")
  assert got[1].raw == '"What is 3+3?,6\n"What is 4+4?",8'
  header = tmp_path / "h.csv"
  header.write_text('"question,answer\nq,1\n')
  with pytest.raises(DatasetError, match=r"as CSV: the header row \(line 2\): unexpected end of data"):
    list(read_custom_jsonl(str(header), {}))


def test_a_pattern_reads_the_shards_in_name_order_as_one_file(tmp_path):
  """The Hub splits larger datasets into shards (`test-00000-of-00003.parquet`, ...): a
  pattern reads them in name order, numbered as the one file holding them would be."""
  whole = _write(tmp_path / "whole.jsonl", "jsonl", GSM)
  shards = tmp_path / "data"
  shards.mkdir()
  for i in (2, 0, 1):  # (written out of order)
    _write(shards / f"test-0000{i}-of-00003.parquet", "parquet", [GSM[i]])
  got = list(read_gsm8k_jsonl(str(shards / "test-*.parquet")))
  assert got == list(read_gsm8k_jsonl(whole))
  assert [e.id for e in got] == ["gsm8k/test/0", "gsm8k/test/1", "gsm8k/test/2"]
  # JSONL shards: the second shard's lines continue the first's numbering.
  _write(shards / "part-a.jsonl", "jsonl", GSM[:2])
  _write(shards / "part-b.jsonl", "jsonl", GSM[2:])
  assert list(read_gsm8k_jsonl(str(shards / "part-?.jsonl"))) == got
  # Blank lines at a shard's end are lines of the one file too (they were not counted:
  # gsm8k/test/0, 1, 2 from the shards, 0, 1, 4 from the file).
  blank = tmp_path / "blank"
  blank.mkdir()
  (blank / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM[:2]) + "\n \n")
  (blank / "b.jsonl").write_text(json.dumps(GSM[2]) + "\n")
  (tmp_path / "ab.jsonl").write_text((blank / "a.jsonl").read_text() + (blank / "b.jsonl").read_text())
  assert [e.id for e in read_gsm8k_jsonl(str(blank / "*.jsonl"))] == [
      e.id for e in read_gsm8k_jsonl(str(tmp_path / "ab.jsonl"))] == [
      "gsm8k/test/0", "gsm8k/test/1", "gsm8k/test/4"]
  # CSV shards: no header takes a number (ids skipped one per shard).
  one_line = [dict(r, answer=r["answer"].replace("\n", " ")) for r in GSM]
  _write(shards / "rows-a.csv", "csv", one_line[:2])
  _write(shards / "rows-b.csv", "csv", one_line[2:])
  assert [e.id for e in read_gsm8k_jsonl(str(shards / "rows-?.csv"))] == [
      "gsm8k/test/0", "gsm8k/test/1", "gsm8k/test/2"]


def test_shards_share_duplicates_and_ids_and_name_the_file(tmp_path):
  a = _write(tmp_path / "a.jsonl", "jsonl", [{"id": "x", "q": "one", "a": "1"}])
  _write(tmp_path / "b.jsonl", "jsonl", [{"id": "y", "q": "two", "a": "2"},
                                         {"id": "x", "q": "one", "a": "1"},
                                         {"id": "x", "q": "three", "a": "3"}])
  got = list(read_custom_jsonl(str(tmp_path / "[ab].jsonl"),
                               {"question": "q", "answer": "a", "id": "id"}))
  assert [e.id for e in got if isinstance(e, Example)] == ["custom/x", "custom/y"]
  dup, = [d for d in got if isinstance(d, Duplicate)]
  assert (dup.source, dup.line_number, dup.first_source, dup.first_line_number) == (
      str(tmp_path / "b.jsonl"), 2, a, 1)
  dead, = [d for d in got if isinstance(d, DeadLetter)]
  assert (dead.source, dead.line_number) == (str(tmp_path / "b.jsonl"), 3)
  assert dead.reason == f"example id 'custom/x' is already used by {a} line 1"


def test_a_pattern_that_matches_nothing_is_one_line_and_a_name_with_brackets_is_a_file(tmp_path):
  with pytest.raises(DatasetError, match=r"^dataset path pattern matches no file: .*/nope-\*\.parquet$"):
    list(read_gsm8k_jsonl(str(tmp_path / "nope-*.parquet")))
  odd = _write(tmp_path / "gsm[1].jsonl", "jsonl", GSM[:1])  # the file itself, not a pattern
  assert [e.question for e in read_gsm8k_jsonl(odd)] == [GSM[0]["question"]]
  # A directory with such a name is itself too; the pattern is what follows it (before:
  # "[1]" read as a character class, and the run stopped: "matches no file").
  (tmp_path / "runs[1]" / "data").mkdir(parents=True)
  _write(tmp_path / "runs[1]" / "data" / "test-0.jsonl", "jsonl", GSM[:1])
  _write(tmp_path / "runs[1]" / "data" / "test-1.jsonl", "jsonl", GSM[1:])
  got = list(read_gsm8k_jsonl(str(tmp_path / "runs[1]" / "data" / "test-*.jsonl")))
  assert [e.question for e in got] == [r["question"] for r in GSM]


def test_a_double_star_reaches_any_depth(tmp_path):
  # Before: "**" matched one directory level, and deeper shards were left out without a word.
  (tmp_path / "a" / "b").mkdir(parents=True)
  _write(tmp_path / "a" / "test-1.jsonl", "jsonl", GSM[1:])
  _write(tmp_path / "a" / "b" / "test-0.jsonl", "jsonl", GSM[:1])
  got = list(read_gsm8k_jsonl(str(tmp_path / "**" / "test-*.jsonl")))
  assert [e.question for e in got] == [r["question"] for r in GSM]  # a/b/test-0 sorts first


def test_parquet_float32_and_decimal_golds_read_as_written(tmp_path):
  """float32 0.1 became the gold "0.10000000149011612" (no reply of 0.1 matched it);
  a decimal 0.0000001 became "1.000E-7" (a dead letter: not a number)."""
  import decimal

  import pyarrow as pa

  from pipelines.datasets.custom_jsonl import read_custom_jsonl
  table = pa.table({"q": ["a", "b", "c"],
                    "f32": pa.array([0.1, 3.14, 1e-7], pa.float32()),
                    "dec": pa.array([decimal.Decimal("0.0000001"), decimal.Decimal("12.50"),
                                     decimal.Decimal("-3")], pa.decimal128(20, 10))})
  pq.write_table(table, tmp_path / "d.parquet")
  for field, want in (("f32", ["0.1", "3.14", "0.0000001"]),
                      ("dec", ["0.0000001000", "12.5000000000", "-3.0000000000"])):
    got = list(read_custom_jsonl(str(tmp_path / "d.parquet"), {"question": "q", "answer": field},
                                 dataset="p", answer_format="number"))
    assert [g.reference for g in got] == want, got
