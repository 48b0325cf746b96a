"""Embedding look-ups where the table lives (embedding_lookup="table", the default):
towers send ids to the table's device and receive only the rows they looked up; the
step still equals one device on the whole batch."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from benchmarks.harness import transfers
from tests import reference
from towers.engine import step
from towers.training import placement

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
VOCAB, WIDTH, LENGTH = 13, 4, 5


def _bag_of_words(seed=0, vocab=VOCAB, regularized=True):
    """ids (B, 5) -> Embedding (id 0 masked, L2 on the table) -> masked mean -> logits."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((LENGTH,), dtype="int32")
    vectors = keras.layers.Embedding(
        vocab, WIDTH, mask_zero=True, name="table",
        embeddings_regularizer=keras.regularizers.L2(0.01) if regularized else None)(ids)
    pooled = keras.layers.GlobalAveragePooling1D()(vectors)
    return keras.Model(ids, keras.layers.Dense(reference.NUM_CLASSES, name="out")(pooled))


def _batches(sizes, vocab=VOCAB):
    rng = np.random.default_rng(3)
    return [(rng.integers(0, vocab, (size, LENGTH)).astype(np.int32),
             rng.integers(0, reference.NUM_CLASSES, size),
             rng.uniform(0.5, 2.0, size).astype(np.float32)) for size in sizes]


class TableLookupTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(optimizer=["sgd", "adam"], embedding_lookup=["table", "copy"])
    def test_trains_as_one_device(self, optimizer, embedding_lookup):
        batches = _batches((7, 2, 6))  # 2 rows on 3 towers: one tower empty
        expected = _bag_of_words()
        reference.single_device_weights(expected, reference.OPTIMIZERS[optimizer](),
                                        reference.make_loss(), batches)
        trainer = towers.TowerTrainer(_bag_of_words(), reference.make_loss(),
                                      reference.OPTIMIZERS[optimizer](), devices=DEVICES[:3],
                                      embedding_lookup=embedding_lookup)
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        self.assertEqual(trainer.setup.tables is not None, embedding_lookup == "table")
        evaluated = trainer.evaluate(batches[0][:2])
        loss = reference.make_loss()(batches[0][1], expected(batches[0][0]))
        self.assertAllClose(evaluated["loss"], loss + tf.add_n(expected.losses), atol=TOLERANCE)

    def test_gradient_holds_only_the_rows_looked_up(self):
        trainer = towers.TowerTrainer(_bag_of_words(regularized=False), reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=DEVICES[:2])
        batch = _batches((6,))[0]
        trainer.train_step(batch)  # sets the trainer up
        with placement.step_hooks(trainer):  # the table read where it lives, as in its step
            grads = tf.function(lambda b: step.run_towers(
                trainer.setup, trainer.objective, b).grads)(batch[:2])
        table = grads[0]
        self.assertIsInstance(table, tf.IndexedSlices)
        self.assertCountEqual(table.indices.numpy(), batch[0].ravel())  # each id, once per use

    def test_bytes_into_a_tower_do_not_grow_with_the_vocabulary(self):
        # What enters tower 1's device in a step (measured as TensorFlow sends it):
        # the same for a 50- and a 5000-row table when rows are looked up where the table
        # lives; the table's growth, whole, when it is copied.
        entering = {}
        for lookup in ("table", "copy"):
            for vocab in (50, 5000):
                trainer = towers.TowerTrainer(
                    _bag_of_words(vocab=vocab, regularized=False), reference.make_loss(),
                    reference.OPTIMIZERS["sgd"](), devices=DEVICES[:2], embedding_lookup=lookup)
                batch = _batches((6,), vocab)[0]
                trainer.train_step(batch)  # sets the trainer up
                moved = transfers.trainer_step_bytes(trainer, batch)
                entering[lookup, vocab] = sum(size for (_, to), size in moved["by_pair"].items()
                                              if to == DEVICES[1])
        self.assertEqual(entering["table", 50], entering["table", 5000])
        self.assertEqual(entering["copy", 5000] - entering["copy", 50], (5000 - 50) * WIDTH * 4)

    def test_model_and_optimizer_handed_back_to_keras_are_as_given(self):
        # Tables are read where they live only while the trainer traces its step.
        model, optimizer = _bag_of_words(), reference.OPTIMIZERS["adam"]()
        trainer = towers.TowerTrainer(model, reference.make_loss(), optimizer,
                                      devices=DEVICES[:2])
        for batch in _batches((6, 5)):
            trainer.train_step(batch)
        trainer.evaluate(_batches((4,))[0])
        # Its steps read rows where the table lives (a gather of the variable itself).
        self.assertIn("ResourceGather", {node.op for node in reference.traced_nodes(trainer)})
        self.assertNotIn("sparse_read", vars(model.get_layer("table").embeddings))
        copy, copy_optimizer = reference.untouched_copy(model, optimizer, _bag_of_words)
        batch = _batches((6,))[0]
        for want, got in zip(
                reference.plain_keras_steps(copy, copy_optimizer, reference.make_loss(), batch),
                reference.plain_keras_steps(model, optimizer, reference.make_loss(), batch)):
            self.assertAllEqual(want, got)

    def test_unknown_lookup_is_refused_in_one_line(self):
        with self.assertRaisesRegex(ValueError, "embedding_lookup must be one of"):
            towers.TowerTrainer(_bag_of_words(), reference.make_loss(),
                                reference.OPTIMIZERS["sgd"](), devices=DEVICES[:1],
                                embedding_lookup="nearby")


if __name__ == "__main__":
    tf.test.main()
