"""keras_hub's transformers, as users bring them (built from a small config, random
weights, nothing downloaded), each step against Keras's compile + train_on_batch on
one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
# Adam's first steps move a weight by about the rate whatever its gradient's size, so a
# gradient near zero passes its float32 round-off (the order of a sum differs between one
# device and towers, and between CPUs' kernels) on magnified: on this machine's CPU the
# largest difference is 1.3e-5 at a rate of 0.01 (one attention kernel entry), 1.3e-6
# at 1e-3.
ADAM_RATE = 1e-3
SEQUENCE, WIDTH, VOCABULARY = 6, 16, 40


def _gpt2(seed=0):
    """GPT2Backbone, 2 layers of 2 heads, width 16: token ids and padding mask in, one
    vector per token out."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=WIDTH,
        intermediate_dim=32, max_sequence_length=SEQUENCE, dropout=0.0)


def _batches(rows=(7, 5), seed=0):
    """Per step: (token ids and a padding mask with padded tails, per-token targets)."""
    rng = np.random.default_rng(seed)
    batches = []
    for n in rows:
        lengths = rng.integers(2, SEQUENCE + 1, n)
        mask = np.arange(SEQUENCE)[None] < lengths[:, None]
        ids = np.where(mask, rng.integers(1, VOCABULARY, (n, SEQUENCE)), 0).astype("int32")
        x = {"token_ids": ids, "padding_mask": mask.astype("int32")}
        batches.append((x, rng.normal(size=(n, SEQUENCE, WIDTH)).astype("float32")))
    return batches


class GPT2Test(tf.test.TestCase):

    def _keras_weights(self, batches):
        model = _gpt2()
        model.compile(keras.optimizers.Adam(ADAM_RATE), "mse")
        for x, y in batches:
            model.train_on_batch(x, y)
        return model.get_weights()

    def test_towers_and_pipeline_stages_train_as_one_device(self):
        batches = _batches()  # 7 rows on 3 towers: 3, 2, 2; 5 rows on 2: 3, 2
        want = self._keras_weights(batches)
        on_towers = towers.TowerTrainer(_gpt2(), "mse", keras.optimizers.Adam(ADAM_RATE),
                                        devices=DEVICES[:3])
        staged = towers.TowerTrainer(_gpt2(), "mse", keras.optimizers.Adam(ADAM_RATE),
                                     devices=[DEVICES[:2], DEVICES[2:]],
                                     pipeline_cuts=["transformer_layer_0"], micro_batches=2)
        for x, y in batches:
            on_towers.train_step((x, y))
            staged.train_step((x, y))
        for trainer in (on_towers, staged):
            for expected, got in zip(want, trainer.model.get_weights()):
                self.assertAllClose(expected, got, atol=TOLERANCE, rtol=0)

    def test_tower_step_calls_the_backbone_as_one_device(self):
        """Your own loop: each tower calls the backbone on its rows of token ids and
        padding mask (a dict; one trace for every tower of a shape), and the mean
        squared error's loss and gradients are one device's."""
        model = _gpt2()
        (x, y), = _batches(rows=(7,))  # 3 towers: 3, 2, 2 rows

        def per_example(call, x, y):
            return tf.reduce_mean(tf.square(call(model, x) - y), axis=[1, 2])

        @tf.function
        def one_device(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(per_example(lambda m, v: m(v), x, y))
            return loss, tape.gradient(loss, model.trainable_variables)

        @tf.function
        def three_towers(x, y):
            out = towers.tower_step(lambda tower, s: ({"mse": per_example(tower, *s)}, None),
                                    (x, y), DEVICES[:3], {"mse": model.trainable_variables})
            return out.losses["mse"], out.grads["mse"]

        (want_loss, want_grads), (loss, grads) = one_device(x, y), three_towers(x, y)
        self.assertAllClose(want_loss, loss, atol=TOLERANCE, rtol=0)
        for want, got in zip(want_grads, grads):
            self.assertAllClose(tf.convert_to_tensor(want), tf.convert_to_tensor(got),
                                atol=TOLERANCE, rtol=0)


# GPT-2's whole LM split by paths: the tied token embedding by vocab (its look-up and
# the LM head's reverse projection), keras_hub's CachedMultiHeadAttention by heads, the
# feed-forward pair column -> row. A key reaches the tied embedding by either of its
# paths (the task model calls the backbone's layer again as its head).
LM_PLAN = {"token_embedding": "vocab",
           "*/transformer_layer_*/self_attention": "heads",
           "*/transformer_layer_*/feedforward_intermediate_dense": "column",
           "*/transformer_layer_*/feedforward_output_dense": "row"}
GRID = [DEVICES[:2], DEVICES[2:]]  # 2 towers x 2 parts


def _lm(seed=0):
    return keras_hub.models.GPT2CausalLM(_gpt2(seed), preprocessor=None)


def _lm_batches(rows=(7, 5), seed=1):
    """Per step: (token ids and padding mask, next-token targets, the padding mask as
    sample weights), as GPT2CausalLM's preprocessor gives them."""
    return [(x, np.roll(x["token_ids"], -1, axis=1), x["padding_mask"])
            for x, _ in _batches(rows, seed)]


def _device(variable):
    """The short name ("/device:CPU:1") of the device `variable` lives on."""
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def _lm_trainer(model, devices):
    return towers.TowerTrainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               keras.optimizers.Adam(0.01), devices=devices)


class GPT2CausalLMTest(tf.test.TestCase):

    def test_split_by_paths_trains_as_keras_on_one_device_and_restores_unsplit(self):
        batches = _lm_batches(rows=(7, 5, 4))
        expected = _lm()
        expected.compile(keras.optimizers.Adam(0.01),
                         keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         weighted_metrics=[])
        wanted = []  # Keras's weights after each step
        for x, y, weights in batches:
            expected.train_on_batch(x, y, sample_weight=weights)
            wanted.append(expected.get_weights())
        parted = towers.split_layers(_lm(), LM_PLAN, DEVICES[:2])
        embedding = parted.backbone.token_embedding
        self.assertIs(parted.get_layer("token_embedding"), embedding)  # one form, both uses
        self.assertEqual([_device(part.embeddings) for part in embedding.parts], DEVICES[:2])
        trainer = _lm_trainer(parted, GRID)
        checkpointer = towers.Checkpointer(self.get_temp_dir(), parted, trainer.optimizer)
        for batch in batches[:2]:
            trainer.train_step(batch)
        joined = towers.join_layers(trainer.model)
        self.assertEqual([w.path for w in joined.weights], [w.path for w in expected.weights])
        for actual, want in zip(joined.get_weights(), wanted[1], strict=True):
            self.assertAllClose(actual, want, atol=TOLERANCE, rtol=0)
        # Saved from 2 parts, restored into the unsplit LM on 2 towers (Adam's slots
        # moved with the weights), trained on: Keras's third step.
        checkpointer.save(epoch=0, batch_in_epoch=2)
        unsplit = _lm(seed=1)
        restoring = _lm_trainer(unsplit, DEVICES[:2])
        restoring.optimizer.build(unsplit.trainable_variables)
        self.assertIsNotNone(towers.Checkpointer(
            checkpointer.directory, unsplit, restoring.optimizer).restore())
        restoring.train_step(batches[2])
        for actual, want in zip(unsplit.get_weights(), wanted[2], strict=True):
            self.assertAllClose(actual, want, atol=TOLERANCE, rtol=0)

    def test_generates_with_its_cache_split_by_heads(self):
        # CachedMultiHeadAttention's key/value cache (B, 2, S, heads, k) is split by heads
        # with them: greedy generation from the split LM gives the unsplit one's tokens.
        lm = _lm()
        parted = towers.split_layers(lm, LM_PLAN, DEVICES[:2])
        prompt = {"token_ids": np.array([[5, 7, 9, 0, 0, 0]], "int32"),
                  "padding_mask": np.array([[1, 1, 1, 0, 0, 0]], "int32")}
        for model in (lm, parted):
            model.compile(sampler="greedy")
        self.assertAllEqual(parted.generate(prompt, stop_token_ids=None)["token_ids"],
                            lm.generate(prompt, stop_token_ids=None)["token_ids"])


class CommandLineTest(tf.test.TestCase):
    """towers-train with a keras_hub model from examples/ and --split_plan paths."""

    def test_split_plan_paths_train_as_the_unsplit_model(self):
        from absl.testing import flagsaver

        from towers.cli import train
        quick = dict(model="examples.hub_transformer:gpt2_classifier", num_towers=2,
                     global_batch_size=16, steps=2, optimizer="adam")
        plan = ["*/token_embedding:vocab", "*/transformer_layer_*/self_attention:heads",
                "*/transformer_layer_*/feedforward_intermediate_dense:column",
                "*/transformer_layer_*/feedforward_output_dense:row"]
        with flagsaver.flagsaver(**quick):
            whole = train.train()
        with flagsaver.flagsaver(**quick, num_parts=2, split_plan=plan):
            parted = train.train()
        self.assertEqual(parted["devices"], [DEVICES[:2], DEVICES[2:]])
        self.assertEqual(list(parted["split_plan"].values()), ["vocab", "heads", "column", "row"])
        self.assertAllClose(parted["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)
        self.assertAllClose(parted["train_loss"], whole["train_loss"], atol=1e-5, rtol=0)

    def test_pipeline_stages_cut_a_causal_lm_inside_its_backbone(self):
        # examples/hub_transformer.py's causal_lm: a GPT2CausalLM (its tied embedding in
        # both stages) inside a functional model, cut two levels deep by estimated
        # compute. Measured: eval loss 3.2e-8 from one device's, train loss equal.
        from absl.testing import flagsaver

        from towers import layer_paths
        from towers.cli import train
        quick = dict(model="examples.hub_transformer:causal_lm", global_batch_size=16,
                     steps=2, optimizer="adam")
        with flagsaver.flagsaver(**quick, num_towers=1):
            whole = train.train()
        with flagsaver.flagsaver(**quick, num_towers=2, pipeline_stages=2):
            staged = train.train()
        self.assertLen(staged["pipeline_cuts"], 1)
        self.assertTrue(layer_paths.matches(staged["pipeline_cuts"][0],
                                            "gpt2_causal_lm*/gpt2_backbone*/transformer_layer_0"),
                        staged["pipeline_cuts"])
        self.assertEqual(staged["devices"], [DEVICES[:2], DEVICES[2:]])
        self.assertAllClose(staged["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)
        self.assertAllClose(staged["train_loss"], whole["train_loss"], atol=1e-5, rtol=0)
