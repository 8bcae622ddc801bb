"""Shared fixtures: the compilation cache and the embedded model, loaded once."""

import pytest

from o1jax.compilation_cache import enable_compilation_cache

enable_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops JAX's compiled programs after each test module. Every XLA:CPU executable
  maps its code into many memory regions; the suite compiles thousands of programs
  (each controller or engine a test builds compiles its own) and one process
  reached the kernel's limit of 65530 mappings, where the next compile crashed."""
  yield
  import gc

  import jax

  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def embedded_checkpoint():
  from o1jax.checkpoint import load_checkpoint

  return load_checkpoint("embedded")


@pytest.fixture(scope="session")
def embedded_generator(embedded_checkpoint):
  from o1jax.model import Generator, Llama

  ck = embedded_checkpoint
  return Generator(Llama(ck.config, ck.params), ck.tokenizer)


# A Qwen3-style chat template (ChatML turns; earlier assistant turns lose their thinking;
# the generation prompt opens the assistant turn, and enable_thinking=false closes an
# empty span).
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
  """(Llama, tokenizer) of a tiny random Qwen3-shaped GGUF whose `<think>`/`</think>` are
  added tokens and whose chat template is QWEN3_STYLE_TEMPLATE."""
  from o1jax.checkpoint import load_checkpoint
  from o1jax.model import Llama
  from o1jax.testing import SPECIAL_TOKENS, tiny_config, write_gguf_checkpoint

  added = ("<think>", "</think>")
  config = tiny_config(architecture="qwen3", qk_norm=True, vocab_size=len(SPECIAL_TOKENS) + 258,
                       max_context=512, name="tiny-qwen3")
  path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
  write_gguf_checkpoint(path, config, seed=3, architecture="qwen3", added_tokens=added,
                        chat_template=QWEN3_STYLE_TEMPLATE)
  ck = load_checkpoint(path)
  return Llama(ck.config, ck.params), ck.tokenizer
