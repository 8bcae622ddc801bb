"""Custom JSONL datasets mapped onto Example by a field mapping."""

import json

import pytest

from pipelines.datasets.custom_jsonl import FieldMapping, read_custom_jsonl
from pipelines.datasets.records import DeadLetter, Example


def _write(tmp_path, rows):
  path = tmp_path / "c.jsonl"
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
  return str(path)


def test_field_mapping_and_metadata(tmp_path):
  path = _write(tmp_path, [
      {"prompt": "What is 6 times 7?", "target": "42", "source": "quiz"},
      {"prompt": "Say hi", "target": "  Hello, world.  "},
  ])
  a, b = read_custom_jsonl(path, {"question": "prompt", "answer": "target"}, dataset="quiz")
  assert a.question == "What is 6 times 7?" and a.reference == "42"
  assert a.dataset == "quiz" and a.metadata == {"source": "quiz"}
  assert b.reference == "Hello, world."  # text format: only whitespace stripped
  # Content-hash ids: stable across reads and independent of line position.
  again = list(read_custom_jsonl(path, {"question": "prompt", "answer": "target"},
                                 dataset="quiz"))
  assert [a.id, b.id] == [e.id for e in again] and a.id != b.id
  path2 = _write(tmp_path, [{"prompt": "Say hi", "target": "  Hello, world.  "}])
  (b2,) = read_custom_jsonl(path2, {"question": "prompt", "answer": "target"}, dataset="quiz")
  assert b2.id == b.id


def test_number_and_gsm8k_formats_and_id_field(tmp_path):
  path = _write(tmp_path, [
      {"uid": 17, "q": "Cost?", "a": "$1,250."},
      {"uid": 18, "q": "Cost?", "a": "about ten"},
  ])
  out = list(read_custom_jsonl(path, {"question": "q", "answer": "a", "id": "uid"},
                               dataset="shop", answer_format="number"))
  assert isinstance(out[0], Example) and out[0].id == "shop/17" and out[0].reference == "1250"
  assert isinstance(out[1], DeadLetter) and "not a number" in out[1].reason

  path = _write(tmp_path, [{"problem": {"text": "Q?"}, "sol": "2+2=4\n#### 4"}])
  mapping = FieldMapping(question="problem.text", answer="sol", answer_format="gsm8k")
  (ex,) = read_custom_jsonl(path, mapping, dataset="nested")
  assert ex.question == "Q?" and ex.reference == "4" and ex.metadata["solution"] == "2+2=4"


def test_an_empty_source_field_name_is_the_configs_fault(tmp_path):
  # Before: every line a dead letter "missing field 'question' (source field '')".
  path = _write(tmp_path, [{"q": "x", "a": "1"}])
  for mapping, message in (({"question": "", "answer": "a"}, r"^dataset.question_field=''"),
                           ({"question": "q", "answer": " "}, r"^dataset.answer_field=' '")):
    with pytest.raises(ValueError, match=message + ": name the records' field that holds"):
      list(read_custom_jsonl(path, mapping))


def test_missing_mapped_field_is_a_dead_letter(tmp_path):
  path = _write(tmp_path, [{"prompt": "x"}, "not json", {"prompt": "y", "target": 3}])
  out = list(read_custom_jsonl(path, {"question": "prompt", "answer": "target"}))
  assert [type(r) for r in out] == [DeadLetter, DeadLetter, Example]
  assert out[0].line_number == 1 and "'answer' (source field 'target')" in out[0].reason
  assert out[1].line_number == 2 and out[1].reason.startswith("invalid JSON")
  assert out[2].reference == "3"
  # Where the line breaks (the reason ended mid-phrase: "Unterminated string starting at").
  cut = _write(tmp_path, ['{"prompt": "x, "target": 3}', '{"prompt": "\x01", "target": 1}'])
  reasons = [r.reason for r in read_custom_jsonl(cut, {"question": "prompt", "answer": "target"})]
  assert reasons == ["invalid JSON: Expecting ',' delimiter at column 17",
                     "invalid JSON: Invalid control character at column 13"]


def test_bad_mapping_rejected():
  with pytest.raises(ValueError, match="unknown target"):
    FieldMapping.from_dict({"questoin": "prompt"})
  with pytest.raises(ValueError, match="answer_format"):
    FieldMapping.from_dict({}, answer_format="float")


def test_gold_answers_written_as_json_numbers_with_exponents_are_numbers(tmp_path):
  # Before: 1e16 became '1e+16' and the line a dead letter ("answer is not a number").
  path = tmp_path / "d.jsonl"
  path.write_text('{"question": "a", "answer": 1e16}\n{"question": "b", "answer": 1E-7}\n'
                  '{"question": "c", "answer": 2.5e-05}\n{"question": "d", "answer": 12}\n'
                  '{"question": "e", "answer": 0.1}\n')
  got = list(read_custom_jsonl(str(path), {}, answer_format="number"))
  assert [e.reference for e in got] == ["10000000000000000", "0.0000001", "0.000025", "12", "0.1"]


def test_text_golds_no_reply_could_match_are_dead_letters(tmp_path):
  """A gold of two lines (a reply is matched by its last line) or one that normalizes to
  nothing ("$", ",,") was scored wrong for every sample, as the model's failure."""
  path = _write(tmp_path, [{"q": "a", "a": "Paris\nFrance"}, {"q": "b", "a": ",,"},
                           {"q": "c", "a": "$"}, {"q": "d", "a": "Paris"},
                           {"q": "e", "a": "Paris\u2028France"}])
  got = list(read_custom_jsonl(path, {"question": "q", "answer": "a"}, dataset="t",
                               answer_format="text"))
  dead = [r for r in got if isinstance(r, DeadLetter)]
  assert [r.reference for r in got if isinstance(r, Example)] == ["Paris"]
  assert "answer has 2 lines: a reply is matched by its last line" in dead[0].reason
  assert "is nothing once normalized" in dead[1].reason and "is nothing once normalized" in dead[2].reason
  assert "answer has 2 lines" in dead[3].reason  # (U+2028 ends a line for the reply's last line)


def test_a_long_bad_gold_is_shown_cut(tmp_path):
  """A 200,000-character non-number gold made a 200 KB dead letter (and launcher line)."""
  path = _write(tmp_path, [{"q": "a", "a": "x" * 200_000}])
  (dead,) = read_custom_jsonl(path, {"question": "q", "answer": "a"}, dataset="t",
                              answer_format="number")
  assert isinstance(dead, DeadLetter) and len(dead.reason) < 300
  assert dead.reason.endswith("... (200000 characters)")
