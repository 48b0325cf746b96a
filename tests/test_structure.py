"""The code's shape, checked: private Keras and TensorFlow names live in towers/compat.py
only, and the packages import downwards only (docs/architecture.md)."""

import ast
import os
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
# Each package may import those after it (docs/architecture.md's order).
LAYERS = ["cli", "training", "multi_worker", "op_parallel", "data_parallel", "model_parallel"]
SHARED = ("devices", "errors", "compat")


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
        offenders = sorted(
            f"{os.path.relpath(path, ROOT)}: {name}"
            for path in _python_files("towers", "benchmarks", "examples")
            if not path.endswith(os.path.join("towers", "compat.py"))
            for name in _imports(path) if name.startswith(PRIVATE_MODULES))
        self.assertEqual(offenders, [])

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


if __name__ == "__main__":
    unittest.main()
