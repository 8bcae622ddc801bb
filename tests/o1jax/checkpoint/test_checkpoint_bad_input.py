"""`check_checkpoint`: the cheap header check a launcher runs before loading anything, and
text the tokenizer cannot take as it is."""

import dataclasses
import json
import time

import numpy as np
import pytest

from o1jax import testing
from o1jax.checkpoint import CheckpointError, check_checkpoint, load_checkpoint, load_tokenizer
from o1jax.checkpoint.gguf_loader import load_gguf
from o1jax.checkpoint.orbax_io import MANIFEST


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  p = tmp_path_factory.mktemp("ck") / "tiny.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config())
  return p


def test_good_checkpoints_pass_and_give_the_loaded_config(tiny_gguf, tmp_path):
  testing.write_hf_checkpoint(tmp_path / "hf", testing.tiny_config())
  for path in (tiny_gguf, tmp_path / "hf"):
    assert check_checkpoint(path) == load_checkpoint(path).config


def test_embedded_model_check_is_cheap():
  t0 = time.perf_counter()
  check_checkpoint("embedded")
  # gguf-py's reader takes seconds on its 49152-token vocabulary; the check walks the header only.
  assert time.perf_counter() - t0 < 1.5


def test_missing_random_and_truncated_files(tiny_gguf, tmp_path):
  with pytest.raises(CheckpointError, match=r"nope.gguf: no such file or directory"):
    check_checkpoint(tmp_path / "nope.gguf")
  rnd = tmp_path / "random.gguf"
  rnd.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(CheckpointError, match=r"random.gguf: not a GGUF file"):
    check_checkpoint(rnd)
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(CheckpointError, match=r"empty.gguf: not a GGUF file"):
    check_checkpoint(empty)
  data = tiny_gguf.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:-1000])
  with pytest.raises(CheckpointError, match=r"cut.gguf: truncated GGUF file: tensor '.*' ends at byte \d+ "
                                            rf"but the file has {len(data) - 1000}"):
    check_checkpoint(cut)
  for n in (40, 200, 2000):  # cut inside the metadata / the tensor table
    head = tmp_path / f"head{n}.gguf"
    head.write_bytes(data[:n])
    with pytest.raises(CheckpointError, match=rf"head{n}.gguf: corrupt or truncated GGUF file"):
      check_checkpoint(head)
  # GGUF magic followed by garbage: counts that cannot fit in the file.
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(CheckpointError, match=r"garbage.gguf: corrupt or truncated GGUF file"):
    check_checkpoint(garbage)


def test_unsupported_architecture_in_header(tmp_path):
  """The header check and the full load refuse it with the same message."""
  p = tmp_path / "arch.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config(), architecture="gpt2")
  for read in (check_checkpoint, load_gguf):
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
      read(p)


def test_bad_hf_and_orbax_directories(tmp_path):
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-64])
  with pytest.raises(CheckpointError, match=r"model.safetensors: cannot be read as safetensors"):
    check_checkpoint(hf)
  (hf / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
    check_checkpoint(hf)
  orbax = tmp_path / "orbax"
  orbax.mkdir()
  (orbax / MANIFEST).write_text(json.dumps({"config": {}}))
  with pytest.raises(CheckpointError, match=rf"orbax/{MANIFEST}: not a valid manifest"):
    check_checkpoint(orbax)


def test_tokenizer_takes_text_with_lone_surrogates():
  tok = testing._tiny_tokenizer()  # pylint: disable=protected-access
  # A lone surrogate is not text the tokenizer library accepts; it becomes U+FFFD.
  assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
  assert tok.encode("plain") == tok.backend.encode("plain", add_special_tokens=False).ids


def _tokenizer_with_template(template):
  from o1jax.checkpoint.tokenizer import Tokenizer
  from o1jax.testing import byte_vocab, SPECIAL_TOKENS
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": byte_vocab(), "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * 256,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.chat_template": template}
  return Tokenizer.from_gguf_metadata(meta)


def test_chat_templates_that_cannot_run_are_named():
  """A template that does not parse fails at load; one that fails on some messages fails
  when it renders them; both with one line naming the chat template. Loop controls
  ({% break %}), which transformers enables, work."""
  with pytest.raises(CheckpointError, match=r"^GGUF: chat template cannot be parsed \(line 1\): "):
    _tokenizer_with_template("{% for m in messages %}{{ m.content }}")
  tok = _tokenizer_with_template("{{ messages[1].content | upper }}")
  with pytest.raises(ValueError, match="^chat template failed to render these messages: "
                                       "UndefinedError"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert tok.apply_chat_template([{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}]) == "B"
  first = _tokenizer_with_template(
      "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
      "{% endfor %}")
  assert first.apply_chat_template([{"role": "user", "content": "x"},
                                    {"role": "user", "content": "y"}]) == "x"
  refuses = _tokenizer_with_template("{{ raise_exception('only user turns') }}")
  with pytest.raises(ValueError, match="^chat template: only user turns$"):
    refuses.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_template_is_not_run_while_compiling_and_what_it_makes_is_bounded(tmp_path):
  """Jinja evaluated constant expressions while compiling: a 17-byte `{{ 'x' * 10**9 }}` in a
  GGUF's metadata took 3 GB (10**10: the process killed) when the checkpoint was only
  checked; `'x'|center(...)` and `'%0...d' % 1` the same. Now they compile at once, and
  rendering them is one line; templates' ordinary arithmetic and filters are unchanged."""
  import resource
  import time
  bombs = ["{{ 'x' * 10**10 }}", "{{ 'x' | center(3000000000) }}", "{{ '%03000000000d' % 1 }}",
           "{{ '%3000000000s' | format(1) }}", "{{ ['x'] * 10**10 }}", "{{ 'x' | indent(10**10) }}",
           "{{ '%*d' % (10**10, 1) }}", "{{ 7 ** (10**9) }}",
           "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
           "{% endfor %}{{ ns.s }}",
           "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
           "{% endfor %}{{ ns.s }}",
           "{{ (('x' * 16777216) | replace('x', 'xy')) | length }}",
           "{% set s = 'x' * 4096 %}{{ ([s] * 8192) | join | length }}",
           "{% set s = 'x' * 4096 %}{{ range(8192) | map('string') | map('replace', '', s) "
           "| join | length }}",
           "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}"]
  gguf = tmp_path / "t.gguf"
  testing.write_gguf_checkpoint(gguf, testing.tiny_config(), chat_template=bombs[0])
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.perf_counter()
  check_checkpoint(gguf)
  for bomb in bombs:
    tok = _tokenizer_with_template(bomb)
    with pytest.raises(ValueError, match=r"^chat template failed to render these messages: "
                                         r"SecurityError: ((a|an|the|center|indent)[^\n]* "
                                         r"(characters|bits)|more than 1,048,576 steps .*)$"):
      tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert time.perf_counter() - start < 20
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 500_000  # KiB
  ordinary = _tokenizer_with_template(
      "{{ 'a' | center(5) }}|{{ 'x' | indent(2, true) }}|{{ '%05d' % 42 }}|{{ 2 ** 10 }}|"
      "{{ [1] * 3 }}|{{ 'ab' + 'cd' }}|{{ '%s-%s' | format(1, 2) }}|{{ 1700000000 | string }}|"
      "{{ messages | map(attribute='role') | join(',') }}|{{ messages | map('upper') | list }}|"
      "{{ messages[0].content | trim | upper }}|{{ [3, 1, 2] | sort | list }}|"
      "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|"
      "{{ '%*d' % (3, 123456789012) }}|{{ '%%%*d' % (4, 7) }}|{{ '<' ~ messages[0].role ~ '>' }}|"
      "{{ 'a-b' | replace('-', '+') }}|{{ ['x', 'y'] | join('.') }}")
  assert ordinary.apply_chat_template([{"role": "user", "content": " hi "}]) == (
      "  a  |  x|00042|1024|[1, 1, 1]|abcd|1-2|1700000000|user|"
      "[\"{'ROLE': 'USER', 'CONTENT': ' HI '}\"]|HI|[1, 2, 3]|1|123456789012|%   7|<user>|a+b|x.y")


def test_a_template_s_work_is_bounded_too(monkeypatch):
  """Bounding what a template makes did not bound its time: two nested loops of 100,000
  turns writing nothing, a macro calling itself twice per level, a loop that copies or
  scans a 16 Mi-character text each turn ran for hours. Now a render has a budget of steps
  (a turn, a call, an operator, a comparison, a filter, and one more per 4096 characters
  or items each reads) and a clock; real templates take ~6-13 steps a message."""
  import time

  from o1jax.checkpoint import tokenizer
  message = [{"role": "user", "content": "hi"}]
  steps = r"^chat template failed to render these messages: SecurityError: more than "
  start = time.perf_counter()
  nested = _tokenizer_with_template(
      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
  with pytest.raises(ValueError, match=steps + r"1,048,576 steps \(loop turns, calls, "
                                             r"operators, filters\)$"):
    nested.apply_chat_template(message)
  copies = _tokenizer_with_template(
      "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s ~ 'y' %}"
      "{% endfor %}")
  with pytest.raises(ValueError, match=steps + "1,048,576 steps"):
    copies.apply_chat_template(message)
  assert time.perf_counter() - start < 5
  monkeypatch.setattr(tokenizer, "_MAX_TEMPLATE_TURNS", 1 << 14)  # (Jinja's macros are slow)
  recursion = _tokenizer_with_template(
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
      "{{ f(60) }}")
  with pytest.raises(ValueError, match=steps + "16,384 steps"):
    recursion.apply_chat_template(message)
  monkeypatch.setattr(tokenizer, "_MAX_TEMPLATE_SECONDS", 0.5)
  monkeypatch.setattr(tokenizer, "_MAX_TEMPLATE_TURNS", 1 << 40)  # (the clock alone)
  scans = _tokenizer_with_template(
      "{% set s = 'x' * 16000000 %}{% for i in range(10000) %}{% set t = 'y' in s %}"
      "{% endfor %}")
  with pytest.raises(ValueError, match=r"^chat template failed to render these messages: "
                                       r"SecurityError: rendering took more than 0.5 s$"):
    scans.apply_chat_template(message)
  # What one step did uncounted (session red-team): comparing lists of lists, a recursive
  # loop's inner items, str methods making 0.4-1 G characters.
  monkeypatch.setattr(tokenizer, "_MAX_TEMPLATE_TURNS", 1 << 20)
  monkeypatch.setattr(tokenizer, "_MAX_TEMPLATE_SECONDS", 10.0)
  big = ("{% set z = ('x' * 1000000) | list %}{% set y = z[:-1] + ['y'] %}"
         "{% set L = (range(1) | batch(3000, z) | first)[1:] %}")  # (2,999 lists of 1 M)
  start = time.perf_counter()
  for bomb, what in (
      ("{% set z = [0] * 3000000 %}{% set y = z[:-1] + [1] %}{{ y in [z] * 3000 }}",
       "SecurityError: a repetition would make more than"),
      ("{% set z = [0] * 3000000 %}{{ z[:-1] in [" + ", ".join(["z"] * 3000) + "] }}",
       "SecurityError: a step reading more than 67,108,864 characters or items"),
      ("{% set z = [0] * 16000000 %}{% for x in [z] recursive %}{% if x is iterable %}"
       "{{ loop(x) }}{% endif %}{% endfor %}", "SecurityError: more than 1,048,576 steps"),
      ("{{ ('\t' * 16000000).expandtabs(64) | length }}", "SecurityError: str.expandtabs would"),
      ("{{ 'x'.ljust(400000000) | length }}", "SecurityError: str.ljust would make more than"),
      ("{{ '{:>400000000}'.format(1) | length }}", "SecurityError: str.format would make"),
      ("{{ '{:.400000000f}'.format(1.0) | length }}", "SecurityError: str.format would make"),
      # (late red-team) tests, list methods, widths from arguments, repeated fields,
      # str.join, filters that multiply their input.
      (big + "{{ y is in(L) }}", "SecurityError: a step reading more than 67,108,864 "),
      (big + "{{ L.count(y) }}", "SecurityError: a step reading more than 67,108,864 "),
      (big + "{{ L | select('eq', y) | list | length }}", "SecurityError: more than 1,048,576 "),
      ("{{ '{:{}}'.format('x', 300000000) | length }}", "SecurityError: str.format would make"),
      ("{{ ('{0}' * 2000).format('x' * 500000) | length }}", "SecurityError: str.format would"),
      ("{{ ('x' * 1000000).join(range(1000) | map('string') | list) | length }}",
       "SecurityError: str.join would make"),
      ("{{ ('\n' * 1000) | indent(1000000, blank=True) | length }}", "SecurityError: indent"),
      ("{{ ('x ' * 100000) | wordwrap(1, wrapstring='y' * 5000) | length }}",
       "SecurityError: a wordwrap would make"),
      ("{{ range(1) | batch(100000000, 'x') | first | length }}", "SecurityError: batch[(]"),
      # (2026-12-07 red-team) bytes, translate, a joined generator, slice, lipsum and
      # integer growth made GBs or took seconds in one step.
      ("{{ ('x'.encode() * 10**9) | length }}", "SecurityError: a repetition would make"),
      ("{{ 'x'.encode().ljust(10**9) | length }}", "SecurityError: str.ljust would make"),
      ("{{ ('x' * 1000000).translate({120: 'y' * 300}) | length }}",
       "SecurityError: str.translate would make"),
      ("{% set t = ['x' * 60000] * 128 %}{{ ('a' * 100000).translate(t) | length }}",
       "SecurityError: str.translate would make"),
      ("{{ 'a'.translate(namespace(x=1)) }}", "SecurityError: str.translate with a Namespace"),
      ("{{ ('x' * 10000).join(range(100000) | map('string')) | length }}",
       "SecurityError: a join would make"),
      ("{{ [] | slice(10**8) | list | length }}", "SecurityError: slice[(]100000000[)] would "
                                                   "make more than 65,536 lists"),
      ("{{ lipsum(150000, false, 20, 100) | length }}", "UndefinedError: 'lipsum' is undefined"),
      ("{% set ns = namespace(x=3) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}"
       "{% endfor %}", "SecurityError: a product of more than 65,536 bits")):
    with pytest.raises(ValueError, match="^chat template failed to render these messages: " + what):
      _tokenizer_with_template(bomb).apply_chat_template(message)
  assert time.perf_counter() - start < 20
  ordinary = _tokenizer_with_template(
      "{% for m in messages %}{{ m.role == 'user' }}{{ 'h' in m.content }}{{ 1 < 2 < 3 }}"
      "{{ m.role in ['user', 'system'] }}{{ 3 not in [1, 2] }}{% endfor %}|"
      "{{ '{:>5}|{:.2f}'.format(1, 2.5) }}{{ 'ab'.ljust(4) }}|{{ 'a\tb'.expandtabs(4) }}|"
      "{{ '{{\"ts\": 1700000000}}'.format() }}|{{ [[1], [2]] | sum(start=[]) }}|"
      "{{ ', '.join(messages | map(attribute='role')) }}{{ [1, 2, 3, 4] | slice(2) | list }}"
      "{{ 'ab'.translate({97: 'xy'}) }}{{ 12345678 * 87654321 }}|"
      "{% for m in [[1, [2, 3]], 4] recursive %}{% if m is iterable %}[{{ loop(m) }}]"
      "{% else %}{{ m }}{% endif %}{% endfor %}")
  assert ordinary.apply_chat_template([{"role": "user", "content": "hi"}]) == (
      "TrueTrueTrueTrueTrue|    1|2.50ab  |a   b|{\"ts\": 1700000000}|[1, 2]|"
      "user[[1, 2], [3, 4]]xyb1082152022374638|[1[23]]4")
  # A chain stops at its first false comparison, as Python's (the later operands were
  # all evaluated first: raise_exception and Undefined reads raised).
  chains = _tokenizer_with_template(
      '{% if 1 > 2 < raise_exception("evaluated") %}x{% endif %}'
      '{% if messages|length > 5 > messages[5].content|length %}x{% endif %}'
      '{% set x = 5 %}{{ 1 < x < 10 < 20 }}{{ 1 < x < 3 < 20 }}ok')
  assert chains.apply_chat_template(message) == "TrueFalseok"
  # Loop variables, filtered and recursive loops, `else` read as before.
  loops = _tokenizer_with_template(
      "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}"
      "{% else %}none{% endfor %}|{% for m in messages if m.role == 'user' %}{{ m.content }}"
      "{% endfor %}|{% for m in messages recursive %}{{ m.content }}{% endfor %}|"
      "{% for x in [] %}x{% else %}empty{% endfor %}")
  assert loops.apply_chat_template([{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}]) == "1/22/2!|a|ab|empty"


def test_a_byte_level_vocabulary_missing_a_byte_says_so_at_load(caplog):
  """A vocabulary without the token for "!" encoded 'a!b+c' as 'ab+c' without a word (as
  llama.cpp does): it still loads, with one warning naming the bytes."""
  import logging
  from o1jax.checkpoint import load_tokenizer
  from o1jax.checkpoint.tokenizer import Tokenizer
  from o1jax.testing import byte_vocab, SPECIAL_TOKENS
  tokens = byte_vocab()
  tokens[tokens.index("!")] = "<|im_start|>"
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * 256,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
  with caplog.at_level(logging.WARNING, logger="o1jax.checkpoint.tokenizer"):
    tok = Tokenizer.from_gguf_metadata(meta, path="t.gguf")
  assert [r.getMessage() for r in caplog.records] == [
      "t.gguf: tokenizer.ggml.tokens has no token for 1 byte of ordinary text (0x21 '!'): "
      "text holding them is encoded without them"]
  assert tok.decode(tok.encode("a!b")) == "ab"  # (what it warns of)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="o1jax.checkpoint.tokenizer"):
    load_tokenizer()  # the embedded model's (it lacks 21 bytes, none of ordinary text): no word
  assert not caplog.records


def test_content_given_as_parts_is_its_text_and_other_parts_are_named():
  """The OpenAI style content [{"type": "text", "text": ...}] is its text parts joined (it
  was jinja's TypeError "can only concatenate str (not "list") to str")."""
  tok = _tokenizer_with_template("{% for m in messages %}<{{ m.role }}>" + "{{ '' + m.content }}"
                                 "{% endfor %}")
  parts = [{"type": "text", "text": "2 + 2"}, {"type": "text", "text": "?"}]
  assert tok.apply_chat_template([{"role": "user", "content": parts}]) == \
      tok.apply_chat_template([{"role": "user", "content": "2 + 2?"}]) == "<user>2 + 2?"
  for bad, message in [
      ([{"type": "image_url", "image_url": {"url": "x.png"}}],
       r"^chat message 0's content part 0 is of type 'image_url': the model reads text parts "),
      (["hi"], r"^chat message 0's content part 0 is 'hi': the model reads text parts "),
      ([{"type": "text", "text": 5}], r"^chat message 0's content part 0 has no 'text' string: ")]:
    with pytest.raises(ValueError, match=message):
      tok.apply_chat_template([{"role": "user", "content": bad}])


def _with_metadata_value(src: bytes, key: str, value: int) -> bytes:
  """A GGUF's bytes with the uint32 metadata value of `key` replaced."""
  import struct
  at = src.index(key.encode()) + len(key)
  assert struct.unpack_from("<I", src, at)[0] == 4  # GGUFValueType.UINT32
  out = bytearray(src)
  struct.pack_into("<I", out, at + 4, value)
  return bytes(out)


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv",
                                 "llama.block_count", "llama.context_length"])
def test_gguf_size_of_zero_is_named_by_check_and_load(tiny_gguf, tmp_path, key):
  # Before: ZeroDivisionError from the loader (head counts), or a model that loaded and then
  # refused every prompt (context 0) or had no layers; the header check passed them all.
  p = tmp_path / "zero.gguf"
  p.write_bytes(_with_metadata_value(tiny_gguf.read_bytes(), key, 0))
  for read in (check_checkpoint, load_gguf):
    with pytest.raises(CheckpointError, match=rf"^{p}: GGUF metadata key '{key}' is 0, "
                                              r"expected an integer >= 1$"):
      read(p)


def test_hf_config_and_tokenizer_files_that_are_not_what_they_should_be(tmp_path):
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  good_config = (hf / "config.json").read_text()
  # Before: AttributeError ('list' object has no attribute 'get').
  (hf / "config.json").write_text("[]")
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: expected a JSON object, got list$"):
    check_checkpoint(hf)
  # Before: ZeroDivisionError computing head_dim, or a model with no heads.
  hf_config = json.loads(good_config)
  hf_config.update(num_attention_heads=0)
  hf_config.pop("head_dim", None)
  (hf / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: n_heads=0 must be >= 1$"):
    check_checkpoint(hf)
  (hf / "config.json").write_text(good_config)
  # Before: the check passed and each worker's load raised a bare JSONDecodeError.
  (hf / "tokenizer_config.json").write_text("{not json")
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{hf}/tokenizer_config.json: not valid JSON \("):
      read(hf)
  (hf / "tokenizer_config.json").unlink()
  # A shard index that does not parse: named, not a bare JSONDecodeError. (Beside a
  # model.safetensors it is not read, as transformers reads that file first.)
  (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
  (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
  with pytest.raises(CheckpointError,
                     match=rf"^{hf}/model.safetensors.index.json: not valid JSON \("):
    check_checkpoint(hf)


@pytest.mark.parametrize("key, value, kind", [("hidden_size", "big", "an integer"),
                                              ("num_hidden_layers", 2.5, "an integer"),
                                              ("vocab_size", True, "an integer"),
                                              ("rms_norm_eps", "1e-6", "a number")])
def test_hf_config_value_of_the_wrong_type_is_named_with_its_key(tmp_path, key, value, kind):
  # Before: "invalid literal for int() with base 10: 'big'" without the key.
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  hf_config = json.loads((hf / "config.json").read_text())
  hf_config[key] = value
  (hf / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: {key}={value!r} is not {kind}$"):
    check_checkpoint(hf)


def test_a_chat_template_that_does_not_parse_is_found_by_the_check(tmp_path):
  # Before: the header check passed and each worker failed at load, without the file.
  broken = "{% for m in messages %}{{ m.content }}"
  gguf = tmp_path / "t.gguf"
  testing.write_gguf_checkpoint(gguf, testing.tiny_config(), chat_template=broken)
  with pytest.raises(CheckpointError, match=rf"^{gguf}: chat template cannot be parsed \(line 1\): "):
    check_checkpoint(gguf)
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  cfg = json.loads((hf / "tokenizer_config.json").read_text())
  (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": broken}))
  with pytest.raises(CheckpointError,
                     match=rf"^{hf}/tokenizer_config.json: chat template cannot be parsed"):
    check_checkpoint(hf)


# --- adversarial headers: one line naming the file and the field, from the check and the load --


class _Gguf:
  """A tiny GGUF (v3, little-endian) as editable parts: metadata [key, type, value] (arrays
  as (item type, [values])), tensor table [name, dims, type, offset], and the data."""

  _SC = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

  def __init__(self, raw: bytes):
    import struct
    self.off, self.raw = 24, raw

    def take(fmt):
      v = struct.unpack_from("<" + fmt, raw, self.off)
      self.off += struct.calcsize("<" + fmt)
      return v

    def string():
      (n,) = take("Q")
      self.off += n
      return raw[self.off - n:self.off].decode()

    def value(t):
      if t in self._SC:
        return take(self._SC[t])[0]
      if t == 8:
        return string()
      item, n = take("IQ")
      return item, [value(item) for _ in range(n)]

    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    self.kvs = []
    for _ in range(n_kv):
      key = string()
      (vtype,) = take("I")
      self.kvs.append([key, vtype, value(vtype)])
    self.tensors = []
    for _ in range(n_tensors):
      name = string()
      (n_dims,) = take("I")
      self.tensors.append([name, list(take(f"{n_dims}Q")), *take("IQ")])
    self.data = raw[self.off + (-self.off % 32):]

  def kv(self, key):
    return next(e for e in self.kvs if e[0] == key)

  def tensor(self, name):
    return next(e for e in self.tensors if e[0] == name)

  def bytes(self) -> bytes:
    import struct

    def string(s):
      return struct.pack("<Q", len(s.encode())) + s.encode()

    def value(t, v):
      if t in self._SC:
        return struct.pack("<" + self._SC[t], v)
      if t == 8:
        return string(v)
      return struct.pack("<IQ", v[0], len(v[1])) + b"".join(value(v[0], x) for x in v[1])

    out = b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.kvs))
    out += b"".join(string(k) + struct.pack("<I", t) + value(t, v) for k, t, v in self.kvs)
    for name, dims, ttype, offset in self.tensors:
      out += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)
    return out + b"\0" * (-len(out) % 32) + self.data


_U32, _I32, _F32, _STR, _ARR = 4, 5, 6, 8, 9


def _set(key, vtype, value):
  def edit(g):
    g.kv(key)[1:] = [vtype, value]
  return edit


def _add(key, vtype, value):
  return lambda g: g.kvs.append([key, vtype, value])


def _tensor(name, field, value):
  def edit(g):
    t = g.tensor(name)
    t[field] = value(g, t[field]) if callable(value) else value
  return edit


def _tokens(n):
  def edit(g):
    tokens, kinds = g.kv("tokenizer.ggml.tokens"), g.kv("tokenizer.ggml.token_type")
    tokens[2] = (_STR, (tokens[2][1] + [f"<x{i}>" for i in range(n)])[:n])
    kinds[2] = (kinds[2][0], (kinds[2][1] + [1] * n)[:n])
  return edit


def _raw(after: bytes, skip: int, patch: bytes):
  """Bytes `patch` written `skip` bytes after the first `after` in the file."""
  def edit(g):
    out = bytearray(g.bytes())
    at = out.index(after) + len(after) + skip
    out[at:at + len(patch)] = patch
    return bytes(out)
  return edit


_Q, _K = "blk.0.attn_q.weight", "blk.0.attn_k.weight"
_META = "GGUF metadata key "
_GGUF_MUTANTS = {
    # Before: a MemoryError (16 GiB for a permutation), ZeroDivisionError or IndexError from
    # the load, a ValueError from ModelConfig without the file, or a model that loaded.
    "size_is_a_string": (_set("llama.attention.head_count", _STR, "4"),
                         _META + r"'llama.attention.head_count' is '4', expected an integer >= 1"),
    "size_is_an_array": (_set("llama.block_count", _ARR, (_U32, [2, 2])),
                         _META + r"'llama.block_count' is an array of 2 uint32, expected an integer >= 1"),
    "size_is_huge": (_set("llama.embedding_length", 10, 2**40),
                     _META + r"'llama.embedding_length' is 1099511627776, expected an integer <= 2147483647"),
    "kv_heads_not_dividing": (_set("llama.attention.head_count_kv", _U32, 3),
                              r"n_heads=4 is not a multiple of n_kv_heads=3"),
    "heads_not_dividing_dim": (_set("llama.attention.head_count", _U32, 5),
                               r"llama.embedding_length 64 is not a multiple of llama.attention.head_count "
                               r"5, and llama.attention.key_length is not set"),
    # The rotary width (llama.cpp writes the head's) is the first thing to disagree.
    "heads_disagree_with_shapes": (_set("llama.attention.head_count", _U32, 8),
                                   r"llama.rope.dimension_count=16 differs from the head size 8 "
                                   r"\(llama.embedding_length / llama.attention.head_count\): "
                                   r"partial rotary is supported for phi3 only"),
    # Before: 34 s and 3.5 GB (per-layer work before the tensor check), a MemoryError.
    "block_count_huge": (_set("llama.block_count", _U32, 10**6),
                         r"llama.block_count is 1000000, more layers than the checkpoint has "
                         r"tensors \(\d+\)"),
    "block_count_too_small": (_set("llama.block_count", _U32, 1),
                              r"tensor 'blk.1.attn_q.weight' is past the model's 1 layers \(llama.block_count\)"),
    "vocab_size_disagrees": (_set("llama.vocab_size", _U32, 300),
                             r"tensor 'token_embd.weight' has shape \(259, 64\), expected \(300, 64\)"),
    "more_tokens_than_vocab": (_tokens(300), r"tokenizer.ggml.tokens has 300 tokens, more than the "
                                             r"model's vocab_size 259"),
    "token_types_too_long": (_set("tokenizer.ggml.token_type", _ARR, (_I32, [1] * 269)),
                             r"tokenizer.ggml.token_type has 269 entries for 259 tokens"),
    "tokens_not_strings": (_set("tokenizer.ggml.tokens", _ARR, (_U32, list(range(259)))),
                           _META + r"'tokenizer.ggml.tokens' is an array of 259 uint32, expected an array "
                                   r"of strings"),
    "eos_past_vocab": (_set("tokenizer.ggml.eos_token_id", _U32, 10**6),
                       _META + r"'tokenizer.ggml.eos_token_id' is 1000000, expected a token id \(0..258\)"),
    "bos_a_string": (_set("tokenizer.ggml.bos_token_id", _STR, "x"),
                     _META + r"'tokenizer.ggml.bos_token_id' is 'x', expected a token id \(0..258\)"),
    "rope_base_a_string": (_set("llama.rope.freq_base", _STR, "1e4"),
                           _META + r"'llama.rope.freq_base' is '1e4', expected a finite number > 0"),
    "chat_template_an_int": (_add("tokenizer.chat_template", _U32, 7),
                             _META + r"'tokenizer.chat_template' is 7, expected a string"),
    "duplicate_key": (_add("llama.block_count", _U32, 1),
                      r"corrupt or truncated GGUF file \(ValueError: metadata key 'llama.block_count' "
                      r"appears twice\)"),
    "alignment_zero": (_add("general.alignment", _U32, 0),
                       r"corrupt or truncated GGUF file \(ValueError: general.alignment 0 is not a "
                       r"power of two\)"),
    "key_length_2_63": (_raw(b"GGUF", 20, (2**63).to_bytes(8, "little")),
                        r"corrupt or truncated GGUF file \(ValueError: a string at byte 24 runs past "
                        r"the end of the file\)"),
    "array_length_2_64": (_raw(b"tokenizer.ggml.tokens", 8, b"\xff" * 8),
                          r"corrupt or truncated GGUF file \(ValueError: an array claims "
                          r"18446744073709551615 items\)"),
    "n_dims_1000": (_raw(_Q.encode(), 0, (1000).to_bytes(4, "little")),
                    rf"corrupt or truncated GGUF file \(ValueError: tensor '{_Q}' claims 1000 dimensions\)"),
    # Before: IndexError / numpy's reshape ValueError, or silently aliased or misread bytes.
    "dims_2_40": (_tensor(_Q, 1, [64, 2**40]),
                  rf"truncated GGUF file: tensor '{_Q}' ends at byte \d+ but the file has 70560"),
    "dim_zero": (_tensor(_Q, 1, [64, 0]), rf"tensor '{_Q}' has dimensions \[64, 0\]: expected sizes >= 1 "
                                           r"and a first one that is a multiple of Q4_1's 32"),
    "dims_swapped": (_tensor(_K, 1, [32, 64]),
                     rf"tensor '{_K}' has shape \(64, 32\), expected \(32, 64\)"),
    "unknown_type": (_tensor(_Q, 2, 99), rf"tensor '{_Q}' has unknown type id 99"),
    "quantized_vector": (_tensor("blk.0.attn_norm.weight", 2, 2),
                         r"tensor 'blk.0.attn_norm.weight' has type Q4_0, expected F32, F16 or BF16 "
                         r"for a vector"),
    "offset_misaligned": (_tensor(_Q, 3, lambda g, off: off + 1),
                          rf"tensor '{_Q}' starts at data offset 17889, not a multiple of the "
                          r"alignment 32"),
    "offsets_overlap": (_tensor(_K, 3, lambda g, off: g.tensor(_Q)[3]),
                        rf"tensors '{_Q}' and '{_K}' overlap in the file"),
    "duplicate_tensor": (_tensor("blk.1.attn_q.weight", 0, _Q),
                         rf"tensor '{_Q}' appears twice in the tensor table"),
    # Before: each loaded as the plain model (a red-team's finds).
    "value_heads_of_their_own": (_add("llama.attention.value_length", _U32, 8),
                                 r"llama.attention.value_length 8 differs from the key heads' 16 "
                                 r"\(.*\); value heads of their own size are not supported"),
    "experts": (_add("llama.expert_count", _U32, 8),
                r"llama.expert_count is 8: mixture-of-experts models are not supported"),
}


def test_gguf_keys_that_say_the_plain_model_load(tiny_gguf, tmp_path):
  g = _Gguf(tiny_gguf.read_bytes())
  _add("llama.expert_count", _U32, 0)(g)  # (dense models' converters write 0)
  _add("llama.attention.value_length", _U32, 16)(g)
  p = tmp_path / "plain.gguf"
  p.write_bytes(g.bytes())
  assert load_checkpoint(p).config == load_checkpoint(tiny_gguf).config


@pytest.mark.parametrize("mutant", list(_GGUF_MUTANTS))
def test_gguf_header_mutants_are_one_line_errors_from_check_and_load(tiny_gguf, tmp_path, mutant):
  edit, message = _GGUF_MUTANTS[mutant]
  g = _Gguf(tiny_gguf.read_bytes())
  p = tmp_path / f"{mutant}.gguf"
  p.write_bytes(edit(g) or g.bytes())
  # load_tokenizer reads only the tokenizer's keys, and checks them as a load does (it
  # built a tokenizer with a BOS past the vocabulary, or raised the tokenizers library's
  # multi-line TypeError for ids given as token texts).
  tokenizer_keys = mutant in ("token_types_too_long", "tokens_not_strings", "eos_past_vocab",
                              "bos_a_string", "chat_template_an_int")
  for read in (check_checkpoint, load_checkpoint) + ((load_tokenizer,) if tokenizer_keys else ()):
    with pytest.raises(CheckpointError, match=rf"^{p}: {message}$"):
      read(p)


def test_gguf_rewriter_round_trips_and_merges_are_checked_at_load(tiny_gguf, tmp_path):
  g = _Gguf(tiny_gguf.read_bytes())
  assert g.bytes() == tiny_gguf.read_bytes()
  # The header check does not read arrays' contents; the load names a malformed merge.
  g.kvs.append(["tokenizer.ggml.merges", _ARR, (_STR, ["a b", "ab"])])
  p = tmp_path / "merges.gguf"
  p.write_bytes(g.bytes())
  check_checkpoint(p)
  with pytest.raises(CheckpointError, match=rf"^{p}: tokenizer.ggml.merges\[1\] 'ab' is not two "
                                            r"tokens separated by a space$"):
    load_checkpoint(p)


def _edit_json(name, **changes):
  def edit(d):
    value = json.loads((d / name).read_text())
    value.update(changes)
    (d / name).write_text(json.dumps(value))
  return edit


def _with_tensors(extra=(), shard2=False):
  """Rewrites model.safetensors with `extra` tensors; shard2: a copy in a second shard."""
  def edit(d):
    import shutil
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors.update({name: np.zeros(shape, np.float32) for name, shape in extra})
    save_file(tensors, str(d / "model.safetensors"))
    if shard2:  # (an index lists both: beside a model.safetensors, that file alone is read)
      shutil.copy(d / "model.safetensors", d / "model2.safetensors")
      (d / "model.safetensors").rename(d / "model1.safetensors")
      (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
          name: ("model1.safetensors" if i % 2 else "model2.safetensors")
          for i, name in enumerate(sorted(tensors))}}))
  return edit


def _sharded(d, index_text):
  """An index beside the weights (a model.safetensors would be read instead of it)."""
  (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
  (d / "model.safetensors.index.json").write_text(index_text)


_CFG = "/config.json: "
_HF_MUTANTS = {
    # Before: AttributeError / TypeError / KeyError / RecursionError, or a model that loaded.
    "rope_scaling_a_string": (_edit_json("config.json", rope_scaling="linear"),
                              _CFG + r"rope_scaling='linear' is not an object"),
    "rope_parameters_a_list": (_edit_json("config.json", rope_parameters=[1]),
                               _CFG + r"rope_parameters=\[1\] is not an object"),
    "rope_scaling_without_factor": (_edit_json("config.json", rope_scaling={"rope_type": "linear"}),
                                    _CFG + r"rope_scaling\['factor'\]=None must be a finite number > 0 "
                                           r"\(rope type 'linear'\)"),
    "rope_theta_nan": (lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": NaN')),
                       _CFG + r"rope_theta=nan is not a number"),
    "eos_an_object": (_edit_json("config.json", eos_token_id={"a": 1}),
                      _CFG + r"eos_token_id=\{'a': 1\} is not a token id \(0..258\) or a list of them"),
    "bos_past_vocab": (_edit_json("config.json", bos_token_id=10**6),
                       _CFG + r"bos_token_id=1000000 is not a token id \(0..258\)"),
    "tie_a_string": (_edit_json("config.json", tie_word_embeddings="false"),
                     _CFG + r"tie_word_embeddings='false' is not true or false"),
    "size_huge": (_edit_json("config.json", hidden_size=2**40),
                  _CFG + r"d_model=1099511627776 must be <= 2147483647"),
    "gemma_layer_types_an_int": (_edit_json("config.json", model_type="gemma3_text", layer_types=3),
                                 _CFG + r"layer_types=3 is not a list of strings"),
    "deep_json": (lambda d: (d / "config.json").write_text("[" * 100000 + "]" * 100000),
                  _CFG + r"not valid JSON \(maximum recursion depth exceeded.*\)"),
    "heads_disagree_with_shapes": (_edit_json("config.json", num_attention_heads=8),
                                   r": tensor 'model.layers.0.self_attn.q_proj.weight' has shape "
                                   r"\(64, 64\), expected \(128, 64\)"),
    "vocab_disagrees": (_edit_json("config.json", vocab_size=300),
                        r": tensor 'model.embed_tokens.weight' has shape \(259, 64\), expected \(300, 64\)"),
    "layers_huge": (_edit_json("config.json", num_hidden_layers=10**9),
                    _CFG + r"num_hidden_layers is 1000000000, more layers than the checkpoint has "
                           r"tensors \(\d+\)"),
    "layers_huge_gemma3": (_edit_json("config.json", model_type="gemma3_text", num_hidden_layers=10**9),
                           _CFG + r"num_hidden_layers is 1000000000, more layers than the checkpoint "
                                  r"has tensors \(\d+\)"),
    "layers_too_few": (_edit_json("config.json", num_hidden_layers=1),
                       r": tensor 'model.layers.1\.[a-z_.]+' is past the model's 1 layers "
                       r"\(config.json's num_hidden_layers\)"),
    "unread_bias": (_with_tensors([("model.layers.0.self_attn.q_proj.bias", (64,))]),
                    r": tensor 'model.layers.0.self_attn.q_proj.bias' is not read by the model "
                    r"config.json describes \(attention_bias=False, model_type 'llama'\)"),
    "tensor_in_two_shards": (_with_tensors(shard2=True),
                             r": tensor 'lm_head.weight' is in both|: tensor '[a-z_.0-9]+' is in both "
                             r"model1.safetensors and model2.safetensors"),
    "weight_map_a_list": (lambda d: _sharded(d, '{"weight_map": [1]}'),
                          r"/model.safetensors.index.json: weight_map is not an object"),
    "weight_map_outside": (lambda d: _sharded(d, '{"weight_map": {"a": "/etc/passwd"}}'),
                           r"/model.safetensors.index.json: weight_map\['a'\]='/etc/passwd' is not the name "
                           r"of a file beside it"),
    "eos_ids_not_a_list": (_edit_json("tokenizer_config.json", o1jax_eos_token_ids=5),
                           r"/tokenizer_config.json: o1jax_eos_token_ids=5 is not a list of token ids "
                           r"\(0..258\)"),
    "bos_token_an_int": (_edit_json("tokenizer_config.json", bos_token=5),
                         r"/tokenizer_config.json: bos_token=5 is not a token \(a string, or an object "
                         r"with a string content\)"),
    "chat_template_list_without_template": (
        _edit_json("tokenizer_config.json", chat_template=[{"name": "default"}]),
        r"/tokenizer_config.json: chat_template=\[\{'name': 'default'\}\] is not a string or a list "
        r"of \{name, template\} objects"),
}


@pytest.mark.parametrize("mutant", list(_HF_MUTANTS))
def test_hf_mutants_are_one_line_errors_from_check_and_load(tmp_path, mutant):
  edit, message = _HF_MUTANTS[mutant]
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  edit(hf)
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{hf}({message})$"):
      read(hf)


def test_tokenizer_larger_than_the_embedding_is_refused_and_a_padded_one_loads(tmp_path):
  # Before: token ids past the embedding's rows loaded, to be clamped on the device.
  small = tmp_path / "small"
  testing.write_hf_checkpoint(small, testing.tiny_config(vocab_size=200))
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{small}: the tokenizer has 259 tokens, more than the "
                                              r"model's vocab_size 200$"):
      read(small)
  padded = tmp_path / "padded"  # an embedding with more rows than tokens (as Qwen's) is fine
  testing.write_hf_checkpoint(padded, testing.tiny_config(vocab_size=320))
  check_checkpoint(padded)
  assert load_checkpoint(padded).config.vocab_size == 320


def test_valid_variants_still_check_and_load(tmp_path):
  for name, config in (("gemma3", testing.tiny_gemma3_config()),
                       ("qwen2", testing.tiny_config(architecture="qwen2", attention_bias=True,
                                                     tie_embeddings=False))):
    p = tmp_path / f"{name}.gguf"
    testing.write_gguf_checkpoint(p, config)
    check_checkpoint(p)
    assert load_checkpoint(p).config.architecture == config.architecture
    hf = tmp_path / name
    testing.write_hf_checkpoint(hf, config, shards=2)
    check_checkpoint(hf)
    assert load_checkpoint(hf).config.n_layers == config.n_layers


@pytest.mark.parametrize("source", [None, 5, b"/tmp"])
def test_a_source_that_is_not_a_name_or_path_is_named(source):
  # Before: pathlib's TypeError ("expected str, bytes or os.PathLike object, not NoneType").
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=r"^a checkpoint source is a model name \(embedded, "
                                              rf"gemma3-270m\) or a path, got {type(source).__name__} "):
      read(source)


@pytest.fixture(scope="module")
def tiny_orbax(tmp_path_factory):
  from o1jax.checkpoint.orbax_io import save_orbax
  root = tmp_path_factory.mktemp("orbax")
  testing.write_hf_checkpoint(root / "hf", testing.tiny_config())
  ck = load_checkpoint(root / "hf")
  save_orbax(root / "orbax", ck.config, ck.params, ck.tokenizer)
  return root / "orbax"


_ORBAX_CONFIG_MUTANTS = {
    # Before: each loaded, to fail (or compute a different model) at the model's first call.
    "more_layers": ({"n_layers": 3}, r"tensor 'layers.2.wq' is missing"),
    "layers_huge": ({"n_layers": 10**6}, rf"{MANIFEST}'s n_layers is 1000000, more layers than the "
                                         r"checkpoint has tensors \(\d+\)"),
    "fewer_layers": ({"n_layers": 1}, r"tensor 'layers.1.attn_norm' is past the model's 1 layers "
                                      rf"\({MANIFEST}'s n_layers\)"),
    "wider": ({"d_model": 128}, r"tensor 'layers.0.wq' has shape \(64, 64\), expected \(128, 64\)"),
    "larger_vocab": ({"vocab_size": 1000}, r"tensor 'embed' has shape \(64, 259\), expected \(64, 1000\)"),
    "bias_switched_on": ({"attention_bias": True}, r"tensor 'layers.0.bq' is missing"),
    "untied": ({"tie_embeddings": False}, r"tensor 'lm_head' is missing"),
}


@pytest.mark.parametrize("mutant", list(_ORBAX_CONFIG_MUTANTS))
def test_orbax_manifest_config_that_disagrees_with_its_arrays_is_named(tiny_orbax, tmp_path, mutant):
  import shutil
  changes, message = _ORBAX_CONFIG_MUTANTS[mutant]
  d = tmp_path / "orbax"
  shutil.copytree(tiny_orbax, d)
  manifest = json.loads((d / MANIFEST).read_text())
  manifest["config"].update(changes)
  (d / MANIFEST).write_text(json.dumps(manifest))
  # The load (arrays restored) and the pre-flight check (orbax's metadata, no arrays read).
  for read in (load_checkpoint, check_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{d}: {message}$"):
      read(d)
  assert check_checkpoint(tiny_orbax) == load_checkpoint(tiny_orbax).config  # unedited: passes


def _orbax_with_arrays(tiny_orbax, d, edit):
  """An orbax checkpoint of the tiny model's arrays after `edit(arrays)`, with a manifest
  whose checksums match them (as a converter of another make would write it)."""
  import orbax.checkpoint as ocp
  from o1jax.checkpoint import orbax_io, params as params_lib
  loaded = load_checkpoint(tiny_orbax)
  arrays, spec = params_lib.flatten(loaded.params)
  edit(arrays)
  d.mkdir()
  with ocp.PyTreeCheckpointer() as ckpt:
    ckpt.save(d / "params", {k.replace(".", "/"): v for k, v in arrays.items()})
  manifest = json.loads((tiny_orbax / MANIFEST).read_text())
  manifest.update(param_spec=spec, checksums={k: orbax_io._checksum(v) for k, v in arrays.items()})
  (d / MANIFEST).write_text(json.dumps(manifest))
  import shutil
  shutil.copytree(tiny_orbax / "tokenizer", d / "tokenizer")
  return d


def _edit(**changes):
  def edit(arrays):
    for name, change in changes.items():
      arrays[name.replace("__", ".")] = change(arrays)
  return edit


_ORBAX_ARRAY_MUTANTS = {
    # Before: each loaded and computed another model without a word (a red-team's finds).
    "lm_head_of_a_tied_model": (  # the model reads params["lm_head"] where there is one
        _edit(lm_head=lambda a: np.zeros((64, 100), np.float32)),
        r"tensor 'lm_head' is not read by the model o1jax_model.json describes \(attention_bias="
        r"False, qk_norm=False, tie_embeddings=True\)"),
    "a_layer_spelled_twice": (  # int("\uff11") == 1: the zeros replaced layer 1's wq
        _edit(**{"layers.\uff11.wq": lambda a: np.zeros_like(a["layers.1.wq"])}),
        r"param_spec does not match the arrays in .* \(ValueError: array 'layers.\uff11.wq': "
        r"'\uff11' is not a layer index in \[0, 2\)\)"),
    "a_zero_padded_layer": (
        _edit(**{"layers.01.wq": lambda a: a.pop("layers.1.wq")}),
        r"param_spec does not match the arrays in .* \(ValueError: array 'layers.01.wq': '01' is "
        r"not a layer index in \[0, 2\)\)"),
    "a_complex_embedding": (  # its imaginary part was dropped
        _edit(embed=lambda a: a["embed"].astype(np.complex64)),
        r"array 'embed' is complex64, expected a float dtype"),
    "an_int_norm": (_edit(final_norm=lambda a: a["final_norm"].astype(np.int32)),
                    r"array 'final_norm' is int32, expected a float dtype"),
}


@pytest.mark.parametrize("mutant", list(_ORBAX_ARRAY_MUTANTS))
def test_orbax_arrays_the_model_would_misread_are_named(tiny_orbax, tmp_path, mutant):
  edit, message = _ORBAX_ARRAY_MUTANTS[mutant]
  d = _orbax_with_arrays(tiny_orbax, tmp_path / "orbax", edit)
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=message):
      read(d)
  control = _orbax_with_arrays(tiny_orbax, tmp_path / "control", lambda arrays: None)
  assert load_checkpoint(control).format == "orbax"


def test_orbax_layer_count_is_bounded_before_any_allocation(tiny_orbax, tmp_path):
  import shutil
  d = tmp_path / "orbax"
  shutil.copytree(tiny_orbax, d)
  manifest = json.loads((d / MANIFEST).read_text())
  manifest["param_spec"]["n_layers"] = 10**12  # was: 10**12 dicts, then MemoryError
  (d / MANIFEST).write_text(json.dumps(manifest))
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=r"param_spec does not match the arrays in .* "
                                              r"\(ValueError: n_layers=1000000000000 must be an "
                                              r"int in \[0, 20\] \(the arrays\)\)$"):
      read(d)


def test_orbax_manifest_config_that_is_not_an_object_is_named(tiny_orbax, tmp_path):
  import shutil
  d = tmp_path / "orbax"
  shutil.copytree(tiny_orbax, d)
  (d / MANIFEST).write_text(json.dumps({"config": [], "param_spec": {}}))
  # Before: AttributeError: 'list' object has no attribute 'get'.
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{d}/{MANIFEST}: not a valid manifest \(ValueError: "
                                              r"a model config is a JSON object, got list\)"):
      read(d)
  assert load_checkpoint(tiny_orbax).format == "orbax"  # the unedited one still loads


def _orbax_copy(tiny_orbax, tmp_path):
  import shutil
  d = tmp_path / "orbax"
  shutil.copytree(tiny_orbax, d)
  return d


def test_orbax_arrays_with_a_flipped_bit_are_refused(tiny_orbax, tmp_path):
  import re
  src = max((p for p in (tiny_orbax / "params").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
  named = []
  for i in range(1, 8):  # one bit at 1/8 .. 7/8 of the largest data file, a fresh copy each
    d = _orbax_copy(tiny_orbax, tmp_path / str(i))
    path = d / src.relative_to(tiny_orbax)
    data = bytearray(path.read_bytes())
    data[len(data) * i // 8] ^= 0x04
    path.write_bytes(bytes(data))
    # Before: most of these loaded, a weight changed (orbax keeps no checksum of the
    # values; a flip inside zstd's literals decodes to other bytes without an error).
    with pytest.raises(CheckpointError) as error:
      load_checkpoint(d)
    message = str(error.value)
    assert message.startswith(f"{d}/params: "), message
    found = re.search(r"array '([\w.]+)' does not match the checksum saved with it "
                      r"\(CRC-32 [0-9a-f]{8}, saved [0-9a-f]{8}\): its files are corrupt", message)
    named += [found.group(1)] if found else []
  assert named, "no flip reached the values: the test no longer covers the checksums"


def test_orbax_checkpoint_without_checksums_still_loads_and_bad_checksums_are_named(
    tiny_orbax, tmp_path):
  d = _orbax_copy(tiny_orbax, tmp_path)
  manifest = json.loads((d / MANIFEST).read_text())
  sums = manifest.pop("checksums")
  assert len(sums) == 20 and all(len(v) == 8 for v in sums.values())
  (d / MANIFEST).write_text(json.dumps(manifest))  # as written before checksums
  loaded, reference = load_checkpoint(d), load_checkpoint(tiny_orbax)
  np.testing.assert_array_equal(loaded.params["embed"], reference.params["embed"])
  for bad, message in (([1, 2], r"checksums must be an object of array name -> 8 hex digits, got list"),
                       (None, r"checksums must be an object of array name -> 8 hex digits, got NoneType"),
                       ({**sums, "embed": "abc"}, r"checksums\['embed'\]='abc' is not a CRC-32"),
                       ({**sums, "embed": 123}, r"checksums\['embed'\]=123 is not a CRC-32"),
                       ({**sums, "extra": "00000000"},
                        r"array 'extra' is only in the manifest's checksums")):
    (d / MANIFEST).write_text(json.dumps({**manifest, "checksums": bad}))
    for read in (load_checkpoint, check_checkpoint):  # the table's format needs no data
      with pytest.raises(CheckpointError, match=message):
        read(d)
  # Upper-case hex is the same checksum.
  (d / MANIFEST).write_text(json.dumps({**manifest, "checksums": {k: v.upper() for k, v in sums.items()}}))
  assert load_checkpoint(d).format == "orbax"


def test_orbax_truncated_arrays_give_one_error_and_no_stray_tracebacks(tiny_orbax, tmp_path):
  import subprocess
  import sys
  d = _orbax_copy(tiny_orbax, tmp_path)
  biggest = max((p for p in (d / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:2000])
  code = ("import time\nfrom o1jax.checkpoint import load_checkpoint\n"
          "for _ in range(3):\n"
          f"  try:\n    load_checkpoint({str(d)!r})\n"
          "  except Exception as e:\n    print(type(e).__name__, e)\n"
          "time.sleep(0.5)\n")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.stdout.startswith(f"CheckpointError {d}/params: cannot be restored"), run.stdout
  # Before: orbax's other reads completed into its closed event loop after the error,
  # each printing an 'Event loop is closed' traceback (2-16 per load; racy: 2 of 3 runs).
  assert "Event loop is closed" not in run.stderr, run.stderr[-2000:]


def test_non_finite_counts_nan_and_inf_of_every_float_type():
  import ml_dtypes
  from o1jax.checkpoint.loader import _non_finite
  for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e5m2,
                ml_dtypes.float8_e4m3fn):
    finite = np.linspace(-400, 400, 3000).astype(dtype)  # up to each type's range (e4m3: 448)
    bad = finite.copy()
    bad[[0, 17, 2999]] = np.nan
    bad[5], bad[6] = np.inf, -np.inf  # (e4m3fn has no inf: NaN)
    want = int(np.count_nonzero(~np.isfinite(bad.astype(np.float64))))
    assert (_non_finite(finite), _non_finite(bad), _non_finite(bad, chunk=7)) == (0, want, want)
  assert _non_finite(np.arange(10)) == 0 and _non_finite(None) == 0
  # Types whose NaN is not the largest magnitude (fnuz: -0's bits) or that have none (fp4/6).
  for dtype in (ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float4_e2m1fn,
                ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn):
    finite = np.array([0, 1, -2, 3, -0.5], np.float32).astype(dtype)
    assert _non_finite(finite) == 0, dtype
    if "fnuz" in np.dtype(dtype).name:
      assert _non_finite(np.array([np.nan, 1, np.nan], np.float32).astype(dtype)) == 2, dtype


def test_a_gguf_scale_that_is_nan_is_named(tmp_path):
  path = tmp_path / "m.gguf"
  testing.write_gguf_with_a_nan_scale(path, testing.tiny_config())  # blk.1.ffn_down, block 3
  # Before: it loaded, and every logit after that layer was NaN (greedy took the last id).
  with pytest.raises(CheckpointError, match=rf"^{path}: tensor 'layers.1.w_down' has 1 non-finite "
                                            r"scales \(NaN or inf\) of \d+: the file is corrupt"):
    load_checkpoint(path)


def test_a_safetensors_weight_that_is_inf_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  import ml_dtypes
  testing.write_hf_checkpoint(tmp_path, testing.tiny_config(), dtype=ml_dtypes.bfloat16)
  weights = load_file(str(tmp_path / "model.safetensors"))
  name = "model.layers.0.self_attn.o_proj.weight"
  weights[name][2, 3], weights[name][0, 0] = np.inf, np.nan
  save_file(weights, str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=rf"^{tmp_path}: tensor 'layers.0.wo' has 2 non-finite "
                                            r"values \(NaN or inf\) of 4096: "):
    load_checkpoint(tmp_path)


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_template_writing_the_bos_token_gets_one_bos(add_bos):
  """Before: `{{ bos_token }}` in the template (Llama 3, Gemma, Mistral) and the
  checkpoint's add_bos gave two BOS tokens; transformers gives one (a rendered chat is
  tokenized without adding special tokens). A template without it gets add_bos's."""
  from o1jax.model.generation import encode_prompt
  chat = [{"role": "user", "content": "a"}]
  writes_bos = _tokenizer_with_template("{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                        "{% endfor %}")
  writes_none = _tokenizer_with_template("{% for m in messages %}{{ m.content }}{% endfor %}")
  for tok in (writes_bos, writes_none):
    tok.add_bos = add_bos
  a = writes_none.encode("a", add_bos=False)
  assert writes_bos.encode_chat(chat) == [1] + a
  assert writes_none.encode_chat(chat) == [1] * add_bos + a
  assert encode_prompt(writes_bos, chat, 10_000) == [1] + a  # what every predictor reads


def test_templates_get_what_transformers_gives_them():
  """strftime_now (Llama 3.2's date, Mistral Small 3 called it unguarded: every render
  failed), transformers' tojson (no HTML escaping, keys in order), `tools`/`documents` as
  None, and the `{% generation %}` block (a template using it did not load)."""
  import datetime
  tok = _tokenizer_with_template(
      "{{ strftime_now('%Y') }}|{{ messages[0] | tojson }}|{{ tools is defined and tools is none }}"
      "|{{ documents is none }}|{% generation %}{{ messages[0].content }}{% endgeneration %}"
      "|{{ {'k': [1, 2]} | tojson(indent=1) }}")
  year = str(datetime.date.today().year)
  got = tok.apply_chat_template([{"role": "user", "content": "<é>&'"}])
  assert got == (f'{year}|{{"role": "user", "content": "<é>&\'"}}|True|True|<é>&\''
                 '|{\n "k": [\n  1,\n  2\n ]\n}')


def test_an_hf_tokenizer_is_read_as_transformers_reads_it(tmp_path):
  """Before: a chat_template.jinja (where transformers >= 4.47 saves the template) was not
  read, so chats got the ChatML fallback; without an `add_bos_token` key no BOS was added,
  where transformers adds the one tokenizer.json's post-processor adds (Llama 3)."""
  import json

  import tokenizers
  from tokenizers import processors

  from o1jax.checkpoint.tokenizer import Tokenizer
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  cfg = json.loads((hf / "tokenizer_config.json").read_text())
  del cfg["add_bos_token"], cfg["chat_template"]
  (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
  assert Tokenizer.load(hf).add_bos is False  # no key, no post-processor: no BOS
  backend = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json"))
  bos = cfg["bos_token"]
  backend.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))])
  backend.save(str(hf / "tokenizer.json"))
  (hf / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m.content }}]"
                                          "{% endfor %}")
  tok = Tokenizer.load(hf)
  assert tok.add_bos and tok.has_chat_template
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == f"{bos}[hi]"
  assert tok.encode("hi")[0] == tok.bos_id and tok.encode_chat(
      [{"role": "user", "content": "hi"}]).count(tok.bos_id) == 1


def test_template_errors_name_their_file_and_filters_fail_in_one_line(tmp_path):
  """(From a red-team of the transformers-like rendering.) A chat_template.jinja that does
  not parse is named (it was tokenizer_config.json); a filter given what it cannot take, or
  an indent that would fill memory, is the one-line render error, not a traceback."""
  from o1jax.checkpoint.tokenizer import Tokenizer
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  (hf / "chat_template.jinja").write_text("{% for m in messages %}")
  with pytest.raises(CheckpointError, match=r"chat_template\.jinja: chat template cannot be parsed"):
    Tokenizer.load(hf)
  chat = [{"role": "user", "content": "x"}]
  for template, error in (("{{ nothing | tojson }}", "TypeError"),
                          ("{{ strftime_now(None) }}", "TypeError"),
                          ("{{ 1 // 0 }}", "ZeroDivisionError"),
                          ("{{ [1] | tojson(indent=2000000000) }}", "ValueError: tojson indent")):
    with pytest.raises(ValueError, match=rf"^chat template failed to render these messages: {error}"):
      _tokenizer_with_template(template).apply_chat_template(chat)


def test_a_tensor_the_model_has_no_place_for_is_named(tmp_path):
  """A bias on the output projection or the FFN (llama.cpp and transformers read them where
  present) loaded as a model without it; tensors read into the config or derived stay."""
  config = testing.tiny_config()
  bias = np.full(config.d_model, 0.5, np.float32)
  for name, extra in (("attn_output", {"blk.0.attn_output.bias": bias}),
                      ("ffn_down", {"blk.1.ffn_down.bias": bias}),
                      ("top_level", {"output.bias": np.zeros(config.vocab_size, np.float32)})):
    p = tmp_path / f"{name}.gguf"
    testing.write_gguf_checkpoint(p, config, extra_tensors=extra)
    tensor = next(iter(extra))
    for read in (check_checkpoint, load_checkpoint):
      with pytest.raises(CheckpointError, match=rf"^{p}: tensor '{tensor}' is not one a 'llama' "
                                                r"model reads, so loading would drop it"):
        read(p)
  kept = tmp_path / "rot.gguf"  # an old converter's rotary table: llama.cpp skips it too
  testing.write_gguf_checkpoint(kept, config, extra_tensors={
      "blk.0.attn_rot_embd": np.ones(config.head_dim // 2, np.float32)})
  assert load_checkpoint(kept).config == check_checkpoint(kept)
  for name, shape in (("model.layers.0.self_attn.o_proj.bias", (config.d_model,)),
                      ("model.layers.1.mlp.down_proj.bias", (config.d_model,))):
    hf = tmp_path / name
    testing.write_hf_checkpoint(hf, config)
    _with_tensors([(name, shape)])(hf)
    for read in (check_checkpoint, load_checkpoint):
      with pytest.raises(CheckpointError, match=rf"^{hf}: tensor '{name}' is not one a 'llama' model "
                                                r"reads"):
        read(hf)
  hf = tmp_path / "inv_freq"  # transformers < 4.31 saved it; computed from the config
  testing.write_hf_checkpoint(hf, config)
  _with_tensors([("model.layers.0.self_attn.rotary_emb.inv_freq", (config.head_dim // 2,)),
                 ("model.rotary_emb.inv_freq", (config.head_dim // 2,))])(hf)
  assert load_checkpoint(hf).config == check_checkpoint(hf)
  # Without an index the weights are model.safetensors, as transformers reads them: another
  # layout's copy beside it (Mistral's consolidated.safetensors) is not read.
  from safetensors.numpy import save_file
  save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)},
            str(hf / "consolidated.safetensors"))
  assert load_checkpoint(hf).config == check_checkpoint(hf)


def _gguf_with(tiny_gguf, tmp_path, name, *edits):
  g = _Gguf(tiny_gguf.read_bytes())
  for edit in edits:
    edit(g)
  p = tmp_path / f"{name}.gguf"
  p.write_bytes(g.bytes())
  return p


def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(tiny_gguf, tmp_path):
  """A factor without a type is linear, the old key rope.scale_linear too (the model ran
  unscaled); a factor of 1 is no scaling, and so is the type "none" whatever the factor
  (llama.cpp sets its freq scale to 1 there: it was read as linear); other types are
  refused."""
  cases = {"no_type": ([_add("llama.rope.scaling.factor", _F32, 4.0)], 4.0),
           "old_key": ([_add("llama.rope.scale_linear", _F32, 2.0)], 2.0),
           "typed": ([_add("llama.rope.scaling.type", _STR, "linear"),
                      _add("llama.rope.scaling.factor", _F32, 8.0)], 8.0),
           "none_type": ([_add("llama.rope.scaling.type", _STR, "none"),
                          _add("llama.rope.scaling.factor", _F32, 4.0)], None),
           "factor_one": ([_add("llama.rope.scaling.factor", _F32, 1.0)], None)}
  for name, (edits, factor) in cases.items():
    p = _gguf_with(tiny_gguf, tmp_path, name, *edits)
    want = None if factor is None else {"rope_type": "linear", "factor": factor}
    assert check_checkpoint(p).rope_scaling == want, name
    assert load_checkpoint(p).config.rope_scaling == want, name
  p = _gguf_with(tiny_gguf, tmp_path, "yarn", _add("llama.rope.scaling.type", _STR, "yarn"),
                 _add("llama.rope.scaling.factor", _F32, 4.0))
  with pytest.raises(CheckpointError, match=r"rope scaling type 'yarn' is not supported"):
    check_checkpoint(p)


def test_gemma3_gguf_without_its_sliding_window_is_refused(tmp_path):
  # Before: every layer global (llama.cpp refuses the file: the key has no default).
  p = tmp_path / "g.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_gemma3_config())
  g = _Gguf(p.read_bytes())
  g.kvs = [kv for kv in g.kvs if kv[0] != "gemma3.attention.sliding_window"]
  p.write_bytes(g.bytes())
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{p}: GGUF metadata key "
                                              r"'gemma3.attention.sliding_window' is missing$"):
      read(p)


def test_a_gemma3_ggufs_layer_flags_are_read_by_the_check_too(tmp_path):
  """The per-layer bool flags of sliding_window_pattern: the header check skipped every
  metadata array, so an irregular pattern passed it and failed only at load."""
  p = tmp_path / "g.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_gemma3_config())
  g = _Gguf(p.read_bytes())
  key = "gemma3.attention.sliding_window_pattern"
  g.kvs = [kv for kv in g.kvs if kv[0] != key]
  _add(key, _ARR, (7, [True, False] * 3))(g)  # (7: bool) every 2nd layer global
  p.write_bytes(g.bytes())
  assert check_checkpoint(p).sliding_window_pattern == 2 == load_checkpoint(p).config.sliding_window_pattern
  g.kv(key)[2] = (7, [False, True, True, False, True, True])  # layers 0 and 3 global
  p.write_bytes(g.bytes())
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{p}: {key} \[False, True, True, False, True, "
                                              r"True\] is not one global layer in every 1 \(the "
                                              r"only interleave supported\)$"):
      read(p)


def test_metadata_arrays_the_model_does_not_read_are_not_kept(tiny_gguf, tmp_path):
  """Every metadata array was read into a Python list at load (~10x its bytes: 2 GB of
  memory for an unused 200 MB array); now only the tokenizer's and small ones."""
  import tracemalloc
  g = _Gguf(tiny_gguf.read_bytes())
  _add("x.blob", _ARR, (_U32, list(range(2_000_000))))(g)
  p = tmp_path / "blob.gguf"
  p.write_bytes(g.bytes())
  tracemalloc.start()
  try:
    loaded = load_checkpoint(p)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 40e6, peak  # the list alone: 2e6 ints, ~72 MB
  assert loaded.config == load_checkpoint(tiny_gguf).config


def test_an_odd_head_size_and_an_unknown_merge_token_are_named(tiny_gguf, tmp_path):
  import dataclasses
  from o1jax.checkpoint.model_config import ModelConfig
  with pytest.raises(ValueError, match=r"head_dim=15 must be even \(RoPE rotates pairs"):
    ModelConfig(**{**dataclasses.asdict(testing.tiny_config()), "head_dim": 15})
  p = _gguf_with(tiny_gguf, tmp_path, "merge", _add("tokenizer.ggml.merges", _ARR, (_STR, ["zz qq"])))
  check_checkpoint(p)  # (the header check does not read arrays' contents)
  with pytest.raises(CheckpointError, match=rf"^{p}: tokenizer.ggml.merges\[0\] 'zz qq' needs the "
                                            r"token 'zz', which tokenizer.ggml.tokens does not hold$"):
    load_checkpoint(p)
  p = _gguf_with(tiny_gguf, tmp_path, "no_tokens", _tokens(0))
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=r"'tokenizer.ggml.tokens' is missing or empty$"):
      read(p)
  with pytest.raises(CheckpointError, match=r"^/dev/null: not a regular file or a directory$"):
    check_checkpoint("/dev/null")
  # A mistyped model name: the names it could have meant.
  with pytest.raises(CheckpointError, match=r"^gemma-270m: no such file or directory \(and not "
                                            r"a named model: embedded, gemma3-270m\)$"):
    check_checkpoint("gemma-270m")


def test_a_big_endian_gguf_loads_when_dense_and_is_refused_when_quantized(tmp_path, monkeypatch):
  """gguf-py writes big-endian files for big-endian machines: the dense tensors' values came
  back byte-swapped (every one counted as NaN); quantized blocks keep their scales in the
  writer's order, which llama.cpp does not read on this machine either."""
  import gguf
  config = testing.tiny_config()
  little = tmp_path / "le.gguf"
  testing.write_gguf_checkpoint(little, config, matrix_type="F16", embed_type="F32")
  real_init = gguf.GGUFWriter.__init__

  def big_endian(self, *args, **kwargs):
    real_init(self, *args, **{**kwargs, "endianess": gguf.GGUFEndian.BIG})

  monkeypatch.setattr(gguf.GGUFWriter, "__init__", big_endian)
  big, quantized = tmp_path / "be.gguf", tmp_path / "be_q.gguf"
  testing.write_gguf_checkpoint(big, config, matrix_type="F16", embed_type="F32")
  testing.write_gguf_checkpoint(quantized, config, matrix_type="Q8_0", embed_type="F32")
  monkeypatch.undo()
  assert check_checkpoint(big) == check_checkpoint(little)
  a, b = load_checkpoint(little).params, load_checkpoint(big).params
  np.testing.assert_array_equal(b["embed"], a["embed"])
  for name in ("wq", "w_down", "attn_norm"):
    assert b["layers"][1][name].dtype.isnative
    np.testing.assert_array_equal(b["layers"][1][name], a["layers"][1][name])
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{quantized}: a big-endian GGUF with quantized "
                                              r"tensors \('blk.0.attn_q.weight' is Q8_0\) is not "
                                              r"supported"):
      read(quantized)


def test_hf_configs_are_read_with_transformers_defaults_and_refusals(tmp_path):
  """Keys a config.json leaves out take their class's default (Gemma 3's rope_theta 1e6 and
  window 4096, Phi-3's eps 1e-5, Mistral's window 4096, Qwen3's head_dim 128, SmolLM3's
  rope_theta 2e6 and tied head); Mistral's window is applied; an
  activation other than SiLU, and Qwen's use_sliding_window, are refused."""
  cases = [
      ("gemma3", testing.tiny_gemma3_config(), ("rope_theta", "sliding_window"),
       {}, dict(rope_theta=1e6, sliding_window=4096)),
      ("smollm3", testing.tiny_config(architecture="smollm3"),
       ("rope_theta", "tie_word_embeddings"), {}, dict(rope_theta=2e6, tie_embeddings=True)),
      ("phi3", testing.tiny_config(architecture="phi3"), ("rms_norm_eps",), {},
       dict(rms_eps=1e-5)),
      ("mistral_default", testing.tiny_config(architecture="mistral"), ("sliding_window",), {},
       dict(sliding_window=4096, sliding_window_pattern=0)),
      ("mistral_4", testing.tiny_config(architecture="mistral"), (), {"sliding_window": 4},
       dict(sliding_window=4, sliding_window_pattern=0)),
      ("mistral_null", testing.tiny_config(architecture="mistral"), (), {"sliding_window": None},
       dict(sliding_window=None)),
      ("qwen2_off", testing.tiny_config(architecture="qwen2", attention_bias=True), (),
       {"sliding_window": 4, "use_sliding_window": False}, dict(sliding_window=None)),
      # (SmolLM3's window was never read: right while use_sliding_window is off)
      ("smollm3_off", testing.tiny_config(architecture="smollm3"), (),
       {"sliding_window": 4, "use_sliding_window": False}, dict(sliding_window=None)),
      ("partial_rotary_one", testing.tiny_config(), (), {"partial_rotary_factor": 1.0},
       dict(rotary_dim=None))]
  for name, config, dropped, changes, want in cases:
    hf = tmp_path / name
    testing.write_hf_checkpoint(hf, config)
    value = json.loads((hf / "config.json").read_text())
    for key in dropped:
      value.pop(key, None)
    value.update(changes)
    (hf / "config.json").write_text(json.dumps(value))
    got = check_checkpoint(hf)
    assert {k: getattr(got, k) for k in want} == want, name
  for name, config, changes, message in (
      ("gelu", testing.tiny_config(), {"hidden_act": "gelu"},
       r"hidden_act 'gelu' is not supported for model_type 'llama' \(supported: 'silu'\)"),
      ("qwen_window", testing.tiny_config(architecture="qwen2", attention_bias=True),
       {"use_sliding_window": True, "sliding_window": 4},
       r"use_sliding_window=true is not supported"),
      # Each loaded as the plain model (full heads rotated, no window), where transformers
      # fails (a rotary table of half the head) or applies the window.
      ("smollm3_window", testing.tiny_config(architecture="smollm3"),
       {"use_sliding_window": True, "sliding_window": 4},
       r"use_sliding_window=true is not supported"),
      ("partial_rotary", testing.tiny_config(), {"partial_rotary_factor": 0.5},
       r"partial_rotary_factor=0.5 is not supported for model_type 'llama' \(its attention "
       r"rotates whole heads\)$"),
      ("partial_rotary_v5", testing.tiny_config(architecture="qwen3", qk_norm=True),
       {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                            "partial_rotary_factor": 0.25}},
       r"partial_rotary_factor=0.25 is not supported for model_type 'qwen3'")):
    hf = tmp_path / name
    testing.write_hf_checkpoint(hf, config)
    _edit_json("config.json", **changes)(hf)
    for read in (check_checkpoint, load_checkpoint):
      with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: {message}"):
        read(hf)
  # A head size left out is the class's (Qwen3: 128), not d_model / heads: here the
  # tensors (16 a head) then disagree with it, as transformers would find too.
  hf = tmp_path / "qwen3_head"
  testing.write_hf_checkpoint(hf, testing.tiny_config(architecture="qwen3", qk_norm=True))
  value = json.loads((hf / "config.json").read_text())
  value.pop("head_dim", None)
  (hf / "config.json").write_text(json.dumps(value))
  with pytest.raises(CheckpointError, match=r"q_proj.weight' has shape \(64, 64\), expected "
                                            r"\(512, 64\)"):
    check_checkpoint(hf)


_ORBAX_SPEC_MUTANTS = {
    # Before: a Q4_1 matrix loaded without its minimums (logits 8 apart), a bare numpy error
    # or ZeroDivisionError at the first forward, a KeyError building the model.
    "minimum_dropped": (lambda spec: spec["quantized"]["layers.0.wq"].update(has_minimum=False),
                        r"array 'layers.0.wq.minimum' is not part of any weight the spec describes"),
    "group_16": (lambda spec: spec["quantized"]["layers.0.wq"].update(group_size=16),
                 r"layers.0.wq: scale shape \(2, 64\) != \(4, 64\)"),
    "group_0": (lambda spec: spec["quantized"]["layers.0.wq"].update(group_size=0),
                r"layers.0.wq: group_size=0 must be an integer >= 1"),
    "more_layers": (lambda spec: spec.update(n_layers=5),
                    r"layer 2 of the spec's n_layers=5 has no arrays"),
}


@pytest.mark.parametrize("mutant", list(_ORBAX_SPEC_MUTANTS))
def test_orbax_param_spec_that_disagrees_with_its_arrays_is_named(tmp_path, mutant):
  from o1jax.checkpoint.orbax_io import save_orbax
  edit, message = _ORBAX_SPEC_MUTANTS[mutant]
  gguf_path, d = tmp_path / "q.gguf", tmp_path / "orbax"
  testing.write_gguf_checkpoint(gguf_path, testing.tiny_config(), matrix_type="Q4_1")
  ck = load_checkpoint(gguf_path)
  save_orbax(d, ck.config, ck.params, ck.tokenizer)
  manifest = json.loads((d / MANIFEST).read_text())
  edit(manifest["param_spec"])
  (d / MANIFEST).write_text(json.dumps(manifest))
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"param_spec does not match the arrays .*{message}"):
      read(d)


def _hf_with_tokenizer(tmp_path, **config_changes):
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  if config_changes:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(config_changes)
    (hf / "config.json").write_text(json.dumps(cfg))
  return hf


def test_hf_generation_config_eos_ids_stop_generation_too(tmp_path):
  """transformers' generate stops on generation_config.json's eos ids as well (Gemma 3's
  <end_of_turn>, Phi-3's <|end|>); they were not read: the model went on past its turn."""
  hf = _hf_with_tokenizer(tmp_path)
  base = load_checkpoint(hf).config.eos_ids
  (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [base[0], 5, 7], "do_sample": True}))
  assert check_checkpoint(hf).eos_ids == base + (5, 7)
  assert load_checkpoint(hf).config.eos_ids == base + (5, 7)
  (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
  with pytest.raises(CheckpointError, match=rf"^{hf}/generation_config.json: eos_token_id=1000000 "
                                            r"is not a token id"):
    check_checkpoint(hf)
  (hf / "generation_config.json").unlink()
  (hf / "generation_config.json").mkdir()  # (not a file: named, not skipped or a traceback)
  with pytest.raises(CheckpointError, match=rf"^{hf}/generation_config.json: not a regular file$"):
    check_checkpoint(hf)


def test_hf_tokenizer_config_that_names_what_the_vocabulary_lacks_is_refused(tmp_path):
  """A bos_token not in tokenizer.json was dropped (prompts went without BOS although
  add_bos_token said so); a list of chat templates without a 'default' fell back to
  ChatML, which transformers refuses."""
  hf = _hf_with_tokenizer(tmp_path)
  cfg_file = hf / "tokenizer_config.json"
  cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
  cfg_file.write_text(json.dumps({**cfg, "bos_token": "<s>", "add_bos_token": True}))
  with pytest.raises(CheckpointError, match=rf"^{cfg_file}: bos_token='<s>' is not a token of "
                                            rf"{hf}/tokenizer.json$"):
    load_checkpoint(hf)
  cfg_file.write_text(json.dumps({**cfg, "chat_template": [{"name": "tool_use", "template": "x"},
                                                           {"name": "rag", "template": "y"}]}))
  with pytest.raises(CheckpointError, match=rf"^{cfg_file}: chat_template lists templates named "
                                            r"\['rag', 'tool_use'\] and none 'default'"):
    load_checkpoint(hf)
  cfg_file.unlink()
  cfg_file.mkdir()
  with pytest.raises(CheckpointError, match=rf"^{cfg_file}: not a regular file$"):
    load_checkpoint(hf)


def test_hf_rope_parameters_theta_wins_over_the_top_level_key(tmp_path):
  """transformers 5 reads the top-level rope_theta only as rope_parameters' default."""
  hf = _hf_with_tokenizer(tmp_path, rope_theta=10000.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  assert check_checkpoint(hf).rope_theta == 500.0


def test_hf_model_safetensors_is_read_before_an_index(tmp_path):
  """As transformers: model.safetensors where there is one (an index beside it named
  shards of other weights, which were loaded)."""
  hf = _hf_with_tokenizer(tmp_path)
  want = load_checkpoint(hf).params["final_norm"]
  other = tmp_path / "other"
  testing.write_hf_checkpoint(other, testing.tiny_config(), seed=9)
  (other / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
  from safetensors import safe_open
  with safe_open(str(hf / "model-00001-of-00001.safetensors"), framework="numpy") as f:
    weight_map = {k: "model-00001-of-00001.safetensors" for k in f.keys()}
  (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  np.testing.assert_array_equal(load_checkpoint(hf).params["final_norm"], want)


def test_model_config_refuses_token_ids_past_its_vocabulary():
  """An orbax manifest's eos_ids [99999] loaded, and the controller's first request failed
  with an IndexError."""
  with pytest.raises(ValueError, match=r"^eos_ids 99999 is not a token id \(0\.\.258\)$"):
    dataclasses.replace(testing.tiny_config(), eos_ids=(2, 99999))
  with pytest.raises(ValueError, match=r"^bos_id -1 is not a token id"):
    dataclasses.replace(testing.tiny_config(), bos_id=-1)
