"""The scripts' shared argument types: a bad value is argparse's one line naming the flag,
before any work; an output file that cannot be written is found before the computation."""

import argparse
import subprocess
import sys

import pytest

from tests.scripts.test_scripts import SCRIPTS, load

args = load("script_args")


def test_counts_numbers_and_levels():
  assert args.count(1)("3") == 3 and args.count(0)("0") == 0
  for text, message in (("0", "expected an int >= 1, got 0"), ("x", "expected an int >= 1, got 'x'")):
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^{message}$"):
      args.count(1)(text)
  assert args.numbers("0.3, 1.2,") == [0.3, 1.2]
  for bad in ("abc", ""):
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated numbers"):
      args.numbers(bad)
  assert args.levels("1,2") == [1, 2]
  with pytest.raises(argparse.ArgumentTypeError, match=r"levels of \[1, 2, 3, 4\], got '7'"):
    args.levels("7")


def test_output_files_are_checked_before_the_work(tmp_path):
  assert args.output_file("") == ""
  assert args.output_file(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
  with pytest.raises(argparse.ArgumentTypeError, match=r"/nope does not exist$"):
    args.output_file(str(tmp_path / "nope" / "x.json"))
  with pytest.raises(argparse.ArgumentTypeError, match=r"is a directory: name a file$"):
    args.output_file(str(tmp_path))


@pytest.mark.parametrize("script, argv, message", [
    # Before: an IndexError after the model loaded; a ValueError traceback; the numbers of
    # every temperature lost to a FileNotFoundError at the end.
    ("calibrate_deepconf", ["--problems", "0"], "argument --problems: expected an int >= 1, got 0"),
    ("study_temperature", ["--temperatures", "abc"],
     "argument --temperatures: expected comma-separated numbers, got 'abc'"),
    ("study_temperature", ["--json", "/proc/nope/x.json"],
     "argument --json: directory /proc/nope does not exist"),
])
def test_scripts_name_a_bad_argument_in_one_line(script, argv, message):
  out = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py")] + argv,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and out.stderr.splitlines()[-1] == f"{script}.py: error: {message}"


def test_a_checkpoint_that_cannot_be_loaded_is_one_line(tmp_path):
  out = subprocess.run([sys.executable, str(SCRIPTS / "calibrate_deepconf.py"), "--model",
                        str(tmp_path / "none.gguf")], capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.splitlines()[-1] == f"error: {tmp_path / 'none.gguf'}: no such file or directory"
