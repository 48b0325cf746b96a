"""The code's shape, checked: private Keras and TensorFlow names live in towers/compat/ only
(the benchmarks' own in benchmarks/harness/compat.py), the packages import downwards only
as docs/architecture.md's table allows (the three techniques not one another), no module
of towers passes 400 lines nor function 8 parameters, and the public surface is what
docs/api.md lists."""

import ast
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
TECHNIQUES = ("data_parallel", "model_parallel", "op_parallel")
MAX_LINES = 400  # past that, a module usually holds two ideas
MAX_PARAMETERS = 8  # past that, some of them belong together in one value
# Keras's own signatures, taken whole: fit's, and MultiHeadAttention.call's.
KERAS_SIGNATURES = ("towers/training/loop.py:fit", "towers/training/trainer.py:fit",
                    "towers/op_parallel/forms.py:call")


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

    def test_packages_import_only_what_the_architecture_allows(self):
        allowed = _allowed_imports()
        packages = {name[:-len(".py")] if name.endswith(".py") else name
                    for name in os.listdir(os.path.join(ROOT, "towers"))
                    if not name.startswith(("_", ".")) and name != "__pycache__"}
        self.assertEqual(sorted(allowed), sorted(packages))  # each has its row
        for technique in TECHNIQUES:  # none plugs into another: the engine joins them
            self.assertFalse(allowed[technique] & set(TECHNIQUES), technique)
        offenders = []
        for path in _python_files("towers"):
            where = os.path.relpath(path, os.path.join(ROOT, "towers")).split(os.sep)
            package = where[0] if len(where) > 1 else where[0][:-len(".py")]
            if package == "__init__":  # the public names, from every package
                continue
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] == "towers" and len(parts) > 1 and parts[1] != package and \
                        parts[1] not in allowed.get(package, ()):
                    offenders.append(f"{os.path.relpath(path, ROOT)} imports {name}")
        self.assertEqual(offenders, [])

    def test_every_function_takes_at_most_8_parameters(self):
        long = []
        for path in _python_files("towers"):
            with open(path) as source:
                tree = ast.parse(source.read())
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                count = len([a for a in arguments if a.arg not in ("self", "cls")])
                where = f"{os.path.relpath(path, ROOT)}:{node.name}"
                if count > MAX_PARAMETERS and where not in KERAS_SIGNATURES:
                    long.append(f"{where}: {count}")
        self.assertEqual(long, [])


def _allowed_imports():
    """{package or shared module: the packages and modules of towers it may import}, read
    from docs/architecture.md's table of packages (its last column)."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as doc:
        rows = [line.split("|") for line in doc if re.match(r"\| `\w+`", line)]
    allowed = {}
    for row in rows:
        may_import = set(re.findall(r"`(\w+)`", row[-2]))
        for name in re.findall(r"`(\w+)`", row[1]):
            allowed[name] = may_import
    return allowed


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
