"""The code's shape, checked: private Keras and TensorFlow names live in towers/compat/ only
(the benchmarks' own in benchmarks/harness/compat.py), the packages import downwards only
(docs/architecture.md), no module of towers passes 400 lines, and the public surface is
what docs/api.md lists."""

import ast
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
# Each package may import those after it (docs/architecture.md's order).
LAYERS = ["cli", "training", "multi_worker", "op_parallel", "data_parallel", "model_parallel"]
SHARED = ("devices", "errors", "compat")
MAX_LINES = 400  # past that, a module usually holds two ideas


def _python_files(*folders):
    for folder in folders:
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(directory, n) for n in names if n.endswith(".py"))


def _imports(path):
    """Every module `path` imports, as written (from-imports with their names)."""
    with open(path) as source:
        tree = ast.parse(source.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


class StructureTest(unittest.TestCase):

    def test_private_keras_and_tensorflow_names_only_in_compat(self):
        allowed = (os.path.join(ROOT, "towers", "compat") + os.sep,
                   os.path.join(ROOT, "benchmarks", "harness", "compat.py"))
        offenders = sorted(
            f"{os.path.relpath(path, ROOT)}: {name}"
            for path in _python_files("towers", "benchmarks", "examples")
            if not path.startswith(allowed)
            for name in _imports(path) if name.startswith(PRIVATE_MODULES))
        self.assertEqual(offenders, [])

    def test_no_module_passes_400_lines(self):
        long = []
        for path in _python_files("towers"):
            with open(path) as source:
                lines = sum(1 for _ in source)
            if lines > MAX_LINES:
                long.append(f"{os.path.relpath(path, ROOT)}: {lines}")
        self.assertEqual(long, [])

    def test_packages_import_downwards_only(self):
        upward = []
        for path in _python_files("towers"):
            package = os.path.relpath(path, os.path.join(ROOT, "towers")).split(os.sep)[0]
            if package not in LAYERS:
                continue
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "towers" or len(parts) < 2 or parts[1] in SHARED:
                    continue
                if parts[1] in LAYERS and LAYERS.index(parts[1]) < LAYERS.index(package):
                    upward.append(f"{os.path.relpath(path, ROOT)} imports {name}")
        self.assertEqual(upward, [])


class PublicSurfaceTest(unittest.TestCase):

    def test_all_is_what_the_api_table_lists(self):
        import towers
        with open(os.path.join(ROOT, "docs", "api.md")) as doc:
            table = [line for line in doc if re.match(r"\| `towers\.", line)]
        listed = {name for line in table for name in re.findall(r"`towers\.(\w+)`", line)}
        self.assertEqual(sorted(towers.__all__), sorted(listed))
        for name in towers.__all__:
            self.assertTrue(hasattr(towers, name), name)

    def test_import_towers_imports_no_command_line(self):
        code = ("import sys, towers; print(sorted(m for m in sys.modules if m.startswith("
                "('towers.cli', 'towers.multi_worker.launch'))))")
        shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
                               timeout=120, check=True).stdout
        self.assertEqual(shown.strip(), "[]")

    def test_old_module_paths_name_the_moved_modules(self):
        import towers
        import towers.trainer  # noqa: F401  (the import statement's form)
        from towers import models, split
        from towers.cli import models as cli_models
        from towers.data_parallel import split as data_parallel_split
        from towers.training import trainer
        self.assertIs(towers.trainer, trainer)
        self.assertIs(sys.modules["towers.trainer"], trainer)
        self.assertEqual(trainer.__spec__.name, "towers.training.trainer")
        self.assertIs(split, data_parallel_split)
        self.assertIs(models, cli_models)
        with self.assertRaises(AttributeError):
            towers.not_a_module  # noqa: B018


if __name__ == "__main__":
    unittest.main()
