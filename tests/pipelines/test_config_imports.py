"""A researcher's own policy from the command line: `--config.imports=` names a module outside
the package, which the launcher and every worker process import; a bad name is one `error:` line."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import custom as custom_config
from pipelines.beam import build_plan
from pipelines.config_imports import ConfigImportError, imports_in_argv, module_names
from tests.o1jax.controller.conftest import docs_example_policy

REPO = pathlib.Path(__file__).resolve().parents[2]


# Each process that imports the researcher's module appends its pid to $MYLAB_IMPORTS.
IMPORT_LOG = "import os\nwith open(os.environ['MYLAB_IMPORTS'], 'a') as log:\n  log.write(f'{os.getpid()}\\n')\n"


@pytest.fixture(scope="module")
def lab(tiny):
  """The tiny checkpoint and questions, and the package `mylab` (not importable here)."""
  (tiny / "mylab").mkdir()
  (tiny / "mylab" / "__init__.py").write_text("")
  (tiny / "mylab" / "policies.py").write_text(IMPORT_LOG + docs_example_policy())
  return tiny


def _cli(lab, *args, imports_log=None):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lab), str(REPO)]),
         "MYLAB_IMPORTS": str(imports_log or lab / "unused.log")}
  return subprocess.run([sys.executable, "-m", "pipelines.eval", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_module_names_as_ml_collections_parses_the_flag():
  assert module_names(("a.b", "c, d")) == ("a.b", "c", "d")
  assert imports_in_argv(["--config.imports=mylab.policies"]) == ("mylab.policies",)
  assert imports_in_argv(["--config.imports=a,b", "--", "--config.imports=c"]) == ("a", "b")
  assert imports_in_argv(["--config.imports=('a', 'b')"]) == ("a", "b")
  assert imports_in_argv(["--config.dataset.n=2"]) == ()


def test_own_policy_runs_on_two_workers_and_every_process_imports_it(lab, tmp_path):
  log, out = tmp_path / "imports.log", tmp_path / "out"
  proc = _cli(lab, "--config=configs/custom.py:policy=greedy_then_vote,smoke=True",
              "--config.imports=mylab.policies", "--config.policy.n=2",
              "--config.policy.max_thinking_tokens=6", "--config.policy.max_answer_tokens=4",
              f"--config.model.source={lab / 'tiny.gguf'}", f"--config.dataset.path={lab / 'q.jsonl'}",
              "--config.prompt.style=completion", "--config.prompt.template=Q: {question}\nA:",
              "--config.runner.direct_num_workers=2", "--config.runner.direct_running_mode=multi_processing",
              "--config.runner.batch_size=2", "--config.runner.progress=False", f"--output_dir={out}",
              imports_log=log)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy"] == "greedy_then_vote" and summary["model"]["predictor"] == "controller"
  assert summary["samples"] == 3 and summary["dead_letters"]["total"] == 0
  assert "--beam_plugins=mylab.policies" in summary["run"]["beam_args"]
  records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  for r in records:
    assert r["trace"]["policy"]["name"] == "greedy_then_vote" and r["trace"]["policy"]["n"] == 2
    assert len(r["trace"]["traces"]) in (1, 3)  # greedy alone, or greedy + n votes
  # The launcher and both worker processes imported the module.
  assert len(set(log.read_text().split())) >= 3


@pytest.mark.parametrize("where", ["flag", "config"])
def test_a_module_that_cannot_be_imported_is_one_error_line(lab, tmp_path, where):
  if where == "flag":  # checked before the config file is read
    expected = ("error: cannot import module 'mylab.nope' named in config.imports: "
                "ModuleNotFoundError: No module named 'mylab.nope'\n")
    proc = _cli(lab, "--config=configs/custom.py:smoke=True", "--config.imports=mylab.nope",
                f"--config.dataset.path={lab / 'q.jsonl'}", f"--output_dir={tmp_path / 'out'}")
    assert proc.returncode == 2 and proc.stderr == expected and proc.stdout == ""
    assert not (tmp_path / "out").exists()  # before any work
  else:  # a config built in Python: the plan imports them first
    cfg = custom_config.get_config("smoke=True")
    cfg.imports = ("json", "no_such_module_anywhere")
    with pytest.raises(ConfigImportError, match="'no_such_module_anywhere' named in config.imports"):
      build_plan(cfg, str(tmp_path / "out"))


@pytest.mark.parametrize("body, message", [
    # Before: each replaced the built-in silently, and a rerun in the same output directory
    # read the built-in's stored verdicts as the new one's (the modules are not hashed).
    ("from pipelines.task_specs import TASKS, GSMTask\n"
     "class Strict(GSMTask):\n  pass\nTASKS['gsm8k'] = Strict\n",
     r"task name 'gsm8k' is taken by pipelines\.task_specs\.GSMTask: register rt_\w+\.Strict "),
    ("from o1jax.controller.verifiers import register_scorer\n"
     "register_scorer('mean_logprob', lambda request, trace: 0.0)\n",
     r"scorer name 'mean_logprob' is taken by o1jax\.controller\.verifiers\._trace_attr"),
    ("from o1jax.controller import register, SampleN\n"
     "@register\nclass Mine(SampleN):\n  name = 'sample_n'\n",
     r"policy name 'sample_n' is taken by o1jax\.controller\.sampling_policies\.SampleN"),
    # Before: the launcher ended with exit status 3 and no word.
    ("import sys\nsys.exit(3)\n", r"named in config\.imports: SystemExit: 3$"),
])
def test_a_module_that_replaces_a_registered_name_or_exits_is_refused(tmp_path, monkeypatch,
                                                                       body, message):
  from pipelines.config_imports import import_modules
  name = f"rt_{abs(hash(body)) % 10**8}"
  (tmp_path / f"{name}.py").write_text(body)
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ConfigImportError, match=message):
    import_modules(name)


def test_a_name_is_held_by_what_the_implementation_is_not_by_its_name(tmp_path):
  # Before: two lambdas of one factory, two partials, or `|=` replaced a name; and a script
  # run as __main__ that its config also imports was refused (one file, two module names).
  import functools
  import importlib.util
  from o1jax.controller.verifiers import _trace_attr
  from o1jax.registry import Registry
  names = Registry("scorer")
  names["a"] = _trace_attr("mean_logprob")
  names["a"] = _trace_attr("mean_logprob")  # the same, made again
  with pytest.raises(ValueError, match=r"^scorer name 'a' is taken"):
    names["a"] = _trace_attr("tail_confidence")
  names["p"] = functools.partial(max, 1)
  with pytest.raises(ValueError, match=r"^scorer name 'p' is taken"):
    names["p"] = functools.partial(min, 1)
  with pytest.raises(ValueError, match=r"^scorer name 'p' is taken"):
    names |= {"p": functools.partial(max, 2)}
  (tmp_path / "mytask.py").write_text("class MyTask:\n  pass\n")
  loaded = []
  for module_name in ("__main_like__", "mytask_again"):
    spec = importlib.util.spec_from_file_location(module_name, tmp_path / "mytask.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    loaded.append(module.MyTask)
  tasks = Registry("task")
  for cls in loaded:  # one file, loaded under two names
    tasks["mytask"] = cls


def test_the_same_implementation_may_register_its_name_again():
  from o1jax.registry import Registry
  names = Registry("thing")
  class A:
    pass
  names["a"] = A
  names["a"] = A  # a module imported twice
  names.update({"b": A})
  with pytest.raises(ValueError, match=r"^thing name 'a' is taken by "):
    names["a"] = int
  assert dict(names) == {"a": A, "b": A}
