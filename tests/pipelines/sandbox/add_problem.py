"""The small HumanEval-style problem the sandbox batteries cheat on.

Its test mixes `==`, math.isclose and abs(), so that each cheat would turn into a
pass if the defence it targets were missing."""
import textwrap

from pipelines.sandbox import HumanEvalProgram

PROMPT = 'import math\n\n\ndef add(a, b):\n    """Return a + b."""\n'
TEST = textwrap.dedent('''\
  import math


  def check(candidate):
      assert candidate(2, 3) == 5
      assert candidate(-1, 1) == 0
      assert math.isclose(candidate(0.1, 0.2), 0.3)
      assert abs(candidate(1.5, 1.5) - 3.0) < 1e-9
''')
RIGHT = '    return a + b\n'
WRONG = '    return a - b\n'


def program(body, module_code='', prompt=PROMPT, test=TEST, entry='add', helpers=()):
  """The completion `body` (the function's body), then `helpers` and `module_code` at module level."""
  source = body + ''.join(helpers) + textwrap.dedent(module_code)
  return HumanEvalProgram(prompt, source, test, entry)
