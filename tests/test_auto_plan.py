"""plan="auto" (issue 37): Megatron's plan found by walking a transformer's layers, for
keras_hub's GPT-2, BERT and Mistral (grouped-query attention, its own attention class:
split by key/value groups) and a plain functional transformer with an untied LM
head. Each plan is the one written by hand; the split model computes the unsplit one's
outputs, and one step on 1 tower x 2 parts equals Keras's on one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests import test_gqa_heads as gqa, test_hub_models as hub
from tests import test_nested_plans as nested
from towers.op_parallel import auto
from towers.op_parallel.plan import parallel_forms

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

PARTS = ["/device:CPU:0", "/device:CPU:1"]
TOLERANCE = 1e-5
SPARSE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCAB, WIDTH, FFN = 30, 8, 20


def _gpt2_lm(seed=0):
    return hub._lm(seed)


def _bert_classifier(seed=0):
    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertTextClassifier(keras_hub.models.BertBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_heads=2, hidden_dim=hub.WIDTH,
        intermediate_dim=32, max_sequence_length=hub.SEQUENCE, dropout=0.0),
        num_classes=3, preprocessor=None, dropout=0.0)


def _functional_lm(seed=0):
    """A plain functional transformer-ish LM: embedding, self-attention, feed-forward
    pair, untied LM head, all top-level layers."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((hub.SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, name="embedding")(ids)
    x = x + keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    up = keras.layers.Dense(FFN, activation="gelu", name="up")(x)
    x = x + keras.layers.Dense(WIDTH, name="down")(up)
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="lm_head")(x))


def _lm_batch():
    x, y, weights = hub._lm_batches(rows=(5,))[0]
    return x, y, weights


def _bert_batch():
    x, _ = hub._batches(rows=(5,))[0]
    x = {**x, "segment_ids": np.zeros_like(x["token_ids"])}
    return x, np.array([0, 2, 1, 1, 0], "int32"), None


def _functional_batch():
    rng = np.random.default_rng(2)
    return (rng.integers(0, VOCAB, (5, hub.SEQUENCE)).astype("int32"),
            rng.integers(0, VOCAB, (5, hub.SEQUENCE)).astype("int32"), None)


# Keys under the backbone's name ("gpt2_backbone", "gpt2_backbone_1" for the second one
# a process builds): the layers keras_hub numbers are one key, with a wildcard.
GPT2_PLAN = {"{}/token_embedding": "vocab",
             "{}/transformer_layer_*/self_attention": "heads",
             "{}/transformer_layer_*/feedforward_intermediate_dense": "column",
             "{}/transformer_layer_*/feedforward_output_dense": "row"}
# Mistral's attention is its own class, grouped-query: split by heads, each part whole
# key/value groups with their query heads (op_parallel/grouped.py).
MISTRAL_PLAN = {"{}/token_embedding": "vocab",
                "{}/transformer_layer_*/self_attention": "heads",
                "{}/transformer_layer_*/feedforward_intermediate_dense": "column",
                "{}/transformer_layer_*/feedforward_gate_dense": "column",
                "{}/transformer_layer_*/feedforward_output_dense": "row"}
BERT_PLAN = {"{}/token_embedding": "vocab",  # one layer: its own path
             "{}/transformer_layer_0/self_attention_layer": "heads",
             "{}/transformer_layer_0/feedforward_intermediate_dense": "column",
             "{}/transformer_layer_0/feedforward_output_dense": "row"}
FUNCTIONAL_PLAN = {"embedding": "vocab", "attention": "heads", "up": "column", "down": "row",
                   "lm_head": "column"}


def _describe(model):
    return [(form.path, type(form).__name__, len(form.parts)) for form in parallel_forms(model)]


class SplitsAsKeras:
    """A TestCase mixin: plan='auto' gives the plan written by hand, and one step of the
    split model on 1 tower x 2 parts equals Keras's on one device."""

    def _splits_and_trains_as_keras(self, build, want_plan, batch, loss=SPARSE):
        """Returns the largest difference from Keras's weights."""
        model = build()
        with self.assertLogs("absl", "INFO") as logged:
            plan = towers.auto_plan(model, num_parts=2)
        backbone = getattr(model, "backbone", None)
        self.assertEqual(plan, {key.format(getattr(backbone, "name", None)): how
                                for key, how in want_plan.items()})
        lines = [r.getMessage() for r in logged.records if "plan='auto': '" in r.getMessage()
                 and "' -> '" in r.getMessage()]
        self.assertLen(lines, len(plan))  # one line per rule
        parted = towers.split_layers(model, "auto", PARTS)
        again = towers.split_layers(model, plan, PARTS)  # the plan reused: the same model
        self.assertEqual(_describe(parted), _describe(again))
        for a, b in zip(parted.weights, again.weights, strict=True):
            self.assertEqual(a.path, b.path)
            self.assertAllEqual(a.numpy(), b.numpy())
        x, y, weights = batch
        self.assertAllClose(parted(x), model(x), atol=TOLERANCE, rtol=0)

        expected = build()
        expected.compile(keras.optimizers.SGD(0.5), loss, weighted_metrics=[])
        expected.train_on_batch(x, y, sample_weight=weights)
        trainer = towers.TowerTrainer(parted, loss, keras.optimizers.SGD(0.5),
                                      devices=[PARTS])  # 1 tower x 2 parts
        trainer.train_step((x, y) if weights is None else (x, y, weights))
        joined = towers.join_layers(parted)
        moved = largest = 0.0
        for want, got, before in zip(expected.get_weights(), joined.get_weights(),
                                     model.get_weights(), strict=True):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
            moved = max(moved, float(np.max(np.abs(want - before), initial=0.0)))
            largest = max(largest, float(np.max(np.abs(want - got), initial=0.0)))
        self.assertGreater(moved, 1e-3)  # the step changed the weights
        return largest


class AutoPlanTest(SplitsAsKeras, tf.test.TestCase):

    def test_gpt2_causal_lm(self):
        self._splits_and_trains_as_keras(_gpt2_lm, GPT2_PLAN, _lm_batch())

    def test_mistral_causal_lm_with_grouped_query_attention(self):
        self._splits_and_trains_as_keras(gqa._mistral, MISTRAL_PLAN, _lm_batch())

    def test_bert_classifier(self):
        self._splits_and_trains_as_keras(_bert_classifier, BERT_PLAN, _bert_batch())

    def test_functional_transformer_with_an_untied_lm_head(self):
        self._splits_and_trains_as_keras(_functional_lm, FUNCTIONAL_PLAN, _functional_batch())

    def test_nested_keras_io_blocks(self):
        self.assertEqual(auto.auto_plan(nested._functional(), 2), {
            "token_and_position_embedding/token_emb": "vocab", "transformer_block/att": "heads",
            "transformer_block/ffn/up": "column", "transformer_block/ffn/down": "row"})

    def test_a_model_with_nothing_to_split_is_refused_in_one_line(self):
        inputs = keras.Input((4,))
        mlp = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs)))
        with self.assertRaisesRegex(ValueError, "plan='auto' finds nothing to split") as caught:
            towers.split_layers(mlp, "auto", PARTS)
        self.assertNotIn("\n", str(caught.exception))

    def test_too_few_units_stay_whole_and_are_logged(self):
        model = _functional_lm()
        with self.assertLogs("absl", "INFO") as logged:
            plan = auto.auto_plan(model, num_parts=3)  # 2 heads: attention stays whole
        self.assertNotIn("attention", plan)
        said = [r.getMessage() for r in logged.records]
        self.assertIn("plan='auto': 'attention' is not split by heads (plan['attention'] = "
                      "'heads' splits 2 heads into 3 parts; give at most 2 devices); its "
                      "projections are split where they can be.", said)
        self.assertIn("plan='auto': 'attention/query' stays whole: plan['attention/query'] = "
                      "'column:d' splits 2 output units into 3 parts; give at most 2 devices",
                      said)


class CommandLineTest(tf.test.TestCase):

    def test_split_plan_auto_trains_as_the_unsplit_model(self):
        from absl.testing import flagsaver

        from towers.cli import train
        quick = dict(model="examples.hub_transformer:gpt2_classifier", num_towers=2,
                     global_batch_size=16, steps=2, optimizer="adam")
        with flagsaver.flagsaver(**quick):
            whole = train.train()
        with flagsaver.flagsaver(**quick, num_parts=2, split_plan=["auto"]):
            parted = train.train()
        self.assertEqual(list(parted["split_plan"].values()), ["vocab", "heads", "column", "row"])
        self.assertAllClose(parted["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)
        self.assertAllClose(parted["train_loss"], whole["train_loss"], atol=1e-5, rtol=0)


if __name__ == "__main__":
    tf.test.main()
