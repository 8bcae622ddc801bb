"""Sandbox for model-generated Python (HumanEval execution).

Every execution gets its own network, PID, mount, IPC and UTS namespaces (plus a
user namespace when not root), a filesystem view with only the system directories
and the interpreter (read-only) and a private size-limited /tmp, a scrubbed
environment, closed stdin, resource limits, and no privileges. A pass needs a
random per-run sentinel that the harness prints only after check() returned.
What this does and does not protect against: docs/sandbox.md.

  sandbox = Sandbox(SandboxConfig(timeout_s=3.0))
  result = sandbox.run(humaneval_program(problem, completion))
  result.status  # Status.PASSED / FAILED / TIMED_OUT / MEMORY_EXCEEDED / CRASHED / SANDBOX_ERROR
  results = sandbox.run_many(programs)  # bounded pool, input order

Sandbox() raises SandboxUnavailableError when the namespaces cannot be created,
unless SandboxConfig(unsafe_no_isolation=True). Count SANDBOX_ERROR separately:
it is the harness's failure, not the model's.
"""
from pipelines.sandbox.config import ExecutionResult, HumanEvalProgram, SandboxConfig, Status
from pipelines.sandbox.runner import Sandbox, SandboxUnavailableError, humaneval_program

__all__ = [
  'ExecutionResult', 'HumanEvalProgram', 'Sandbox', 'SandboxConfig', 'SandboxUnavailableError',
  'Status', 'humaneval_program',
]
