"""All three techniques at once: towers x pipeline stages x parts (issue 27, part 1),
on 8 logical devices, in a process of its own (tests/grid_job.py), against Keras's
compile + train_on_batch on one device."""

import json
import os
import re
import subprocess
import sys

import tensorflow as tf

from tests import grid_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5


def _expected_device(path):
    """Where grid_job's variable `path` must live: stage k's part j on grid[0][k][j]
    (CPU:2k+j), stage k's other variables on grid[0][k][0]; the cut is after block_0."""
    stage = 0 if path.startswith(("embed/", "block_0/")) else 1
    part = re.search(r"/part_(\d)/", path)
    return f"/device:CPU:{2 * stage + (int(part.group(1)) if part else 0)}"


class GridTest(tf.test.TestCase):

    def test_towers_by_stages_by_parts_train_as_one_device(self):
        output = os.path.join(self.get_temp_dir(), "grid.json")
        run = subprocess.run([sys.executable, "-m", "tests.grid_job", output], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        with open(output) as f:
            results = json.load(f)
        # 2 towers x 2 stages x 2 parts, 1F1B with 4 micro-batches, 2 steps (9, 7 rows).
        self.assertLess(results["1f1b"], TOLERANCE)
        # GPT2CausalLM: plan="auto" over the parts, cut inside its backbone, its tied
        # embedding in both stages (measured: 2.5e-7).
        self.assertLess(results["causal_lm"], TOLERANCE)
        # Its checkpoint restored into the unsplit model, which trains step 3.
        self.assertLess(results["restored_unsplit"], TOLERANCE)
        # fit over the 3 batches, GPipe with 2 micro-batches, spread placement; evaluate
        # as Keras's.
        self.assertLess(results["fit_gpipe_spread"], TOLERANCE)
        self.assertAllClose(*results["evaluate"], atol=TOLERANCE, rtol=0)
        # Every variable and its optimizer slot where its column lives.
        placement = results["placement"]
        self.assertLen(placement, 56)
        for path, (variable_device, slot_device) in placement.items():
            self.assertEqual((variable_device, slot_device), (_expected_device(path),) * 2,
                             path)
        # Spread placement: each variable, or each slab of one slabbed across towers
        # (".../kernel_slab_1/kernel"), on one tower's device for its stage and part.
        spread = results["spread_placement"]
        self.assertGreater(len(spread), len(placement))  # some variables are slabbed
        for path, device in spread:
            home = int(_expected_device(path).rsplit(":", 1)[1])
            self.assertIn(device, [f"/device:CPU:{home}", f"/device:CPU:{home + 4}"], path)
        self.assertLen({device for _, device in spread}, 8)
        # Each split layer runs, outside a tower, where its stage's parts live.
        self.assertEqual(results["forms"], {
            f"block_{k}/{name}": grid_job.GRID[0][k]
            for k in (0, 1) for name in ("att", "ffn/up", "ffn/down")})


if __name__ == "__main__":
    tf.test.main()
