"""--help of the entry points: towers-train (both ways of starting it) and the benchmarks.

absl's short help lists the flags of the module it takes for the main one; these check that
each program lists its own flags, with their help, and none of absl's and TensorFlow's.
"""

import configparser
import os
import re
import subprocess
import sys

from absl import flags
from absl.testing import absltest, parameterized

from towers.cli import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One flag's entry in absl's help: "  --name: ...", "  --[no]name: ...", "  -?,--[no]help: ...",
# up to the next entry or module heading.
FLAG_ENTRY = re.compile(r"^  (?:-\S,)?--(?:\[no\])?(\w+): (.*?)(?=^  -|^\S|\Z)", re.M | re.S)
DEFINED_FLAG = re.compile(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"")


def _console_script(name):
    """`MODULE:FUNCTION` of the console script NAME, as setup.cfg declares it."""
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    scripts = dict(line.split(" = ") for line in
                   setup["options.entry_points"]["console_scripts"].strip().splitlines())
    return scripts[name]


def _help(command):
    """Runs COMMAND (a list) from the repository root; returns the CompletedProcess and
    {flag name: its help entry} read from its stdout."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=120)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result, dict(FLAG_ENTRY.findall(result.stdout))


def _squeezed(text):
    """TEXT without whitespace: absl wraps help text at any space or hyphen."""
    return "".join(text.split())


class TowersTrainHelpTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("module_help", [sys.executable, "-m", "towers.train", "--help"]),
        ("module_helpshort", [sys.executable, "-m", "towers.train", "--helpshort"]),
        # What the script pip writes does: argv[0] is the script, __main__ has no docstring.
        ("console_script", [sys.executable, "-c",
                            "import sys; sys.argv[0] = 'towers-train'; "
                            "from {} import {} as entry_point; sys.exit(entry_point())".format(
                                *_console_script("towers-train").split(":")),
                            "--helpshort"]),
    )
    def test_lists_every_flag_of_the_program_with_its_help(self, command):
        result, listed = _help(command)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        defined = {flag.name: flag.help for flag in flags.FLAGS.get_flags_for_module(train)}
        defined["log_dir"] = flags.FLAGS["log_dir"].help  # absl.logging's, with our help
        self.assertContainsSubset(
            ["num_towers", "global_batch_size", "pipeline_stages", "split_plan"], listed)
        self.assertSameElements(defined, listed)
        for name, help_text in defined.items():
            self.assertIn(_squeezed(help_text), _squeezed(listed[name]), name)
        self.assertStartsWith(result.stdout, "towers-train: train a model")
        self.assertNotIn("absl.flags:", result.stdout)
        self.assertNotIn("--flagfile", result.stdout)


class BenchmarkHelpTest(parameterized.TestCase):

    # compare_strategies imports TensorFlow before its flags, the others do not.
    @parameterized.parameters("compare_strategies", "accumulation_memory", "multi_worker",
                              "custom_step", "memory", "keras_path", "first_step",
                              "masked_split_step", "loop_first_step")
    def test_lists_the_flags_the_benchmark_defines(self, name):
        path = os.path.join("benchmarks", f"{name}.py")
        with open(os.path.join(ROOT, path)) as source:
            defined = DEFINED_FLAG.findall(source.read())
        result, listed = _help([sys.executable, path, "--help"])  # exits 1, as absl does
        self.assertNotEmpty(defined)
        self.assertSameElements(defined, listed)
        self.assertTrue(all(listed.values()), listed)
        self.assertNotIn("--flagfile", result.stdout)


if __name__ == "__main__":
    absltest.main()
