"""The misuse probe: mistakes across the Python API and towers-train that get one line
naming the argument (or flag) and what would be right, before anything is applied or
written; kept so that none regresses.

Each table row is (what the mistake is, the call, the argument the message names, a
regex of the message[, assertRefused's options]). A refused call never traces a step:
the shared trainer (trained one step) has its weights and step count as before.
tests/test_misuse_api.py, _cli and _checkpoints hold the mistakes that once got a stack
trace or a silent answer."""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import towers
from tests import reference, test_misuse_api
from tests.test_train import _main_in_process
from towers.data_parallel import split

DEVICES = test_misuse_api.DEVICES  # 3 towers
STAGE_DEVICES = [DEVICES[:2]]  # one tower of two pipeline stages, or of two parts


def _trainer(model=None, loss=None, **kwargs):
    """A fresh trainer: the reference model and loss unless given, SGD, three towers."""
    kwargs.setdefault("devices", DEVICES)
    return towers.TowerTrainer(model or reference.make_model(), loss or reference.make_loss(),
                               keras.optimizers.SGD(0.1), **kwargs)


def _two_outputs():
    """A functional model of two outputs: "cls" (3 logits) and "value" (1 number)."""
    inputs = keras.Input((reference.NUM_FEATURES,))
    return keras.Model(inputs, {"cls": keras.layers.Dense(3, name="cls")(inputs),
                                "value": keras.layers.Dense(1, name="value")(inputs)})


def _integer_output():
    """A model whose one output is int32 (a cast of 3 logits)."""
    inputs = keras.Input((reference.NUM_FEATURES,))
    return keras.Model(inputs, keras.layers.Lambda(lambda t: keras.ops.cast(t, "int32"))(
        keras.layers.Dense(3)(inputs)))


def _one_batch():
    """A generator function of no argument: fit calls a callable with the epoch."""
    yield reference.make_batches(8, num_steps=1)[0]


def _two_loss_trainer(**kwargs):
    return _trainer(_two_outputs(), {"cls": reference.make_loss(), "value": "mse"}, **kwargs)


class ProbeTest(tf.test.TestCase):
    """The Python API, one table per area."""

    assertRefused = test_misuse_api.MisuseTest.assertRefused

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.x, cls.y, cls.w = reference.make_batches(8, num_steps=1)[0]
        cls.trainer = _trainer()
        cls.trainer.train_step((cls.x, cls.y, cls.w))
        cls.trainer.train_step((cls.x, cls.y.astype("float32"), cls.w))  # whole float labels
        cls.trainer.evaluate((cls.x, cls.y.astype("float32"), cls.w))
        cls.dataset = tf.data.Dataset.from_tensor_slices((cls.x, cls.y)).batch(4)
        cls.up_down = reference.make_up_down_model()  # layers "up", "down", "out"
        cls.directory = cls.enterClassContext(tempfile.TemporaryDirectory())
        cls.a_file = os.path.join(cls.directory, "a_file")
        open(cls.a_file, "w").close()

    def assert_all_refused(self, cases):
        for description, call, argument, message, *options in cases:
            with self.subTest(description):
                self.assertRefused(call, argument, message, **(options[0] if options else {}))

    def test_trainer_options_out_of_their_values(self):
        bad_values = {
            "aggregation": ["bogus"], "pack_gradients": ["yes"],
            "variable_placement": ["bogus"], "accum_steps": [0, 2.5, True],
            "clip_global_norm": [0, "1"], "sparse_policy": ["bogus", 1.5],
            "state_policy": ["bogus"], "on_nonfinite": ["ignore"], "micro_batches": [0],
            "pipeline_schedule": ["bogus"], "steps_per_execution": [0, "2"],
            "prefetch_to_devices": ["yes"], "embedding_lookup": ["bogus"],
            "weighted_metrics": ["accuracy"], "pipeline_cuts": ["up"], "loss_weights": ["a"],
            "jit_compile": ["no", 1],
        }
        self.assert_all_refused([
            (f"{option}={value!r}", lambda option=option, value=value: _trainer(
                **{option: value}), option, rf"^{option} must be ")
            for option, values in bad_values.items() for value in values])

    def test_trainer_arguments(self):
        split_model = towers.split_layers(self.up_down, {"up": "column"}, DEVICES[:2])
        self.assert_all_refused([
            ("model not a keras.Model", lambda: _trainer(model="mlp"), "model",
             r"^model must be a keras.Model, got str"),
            ("optimizer an unknown name", lambda: towers.TowerTrainer(
                reference.make_model(), reference.make_loss(), "sgdd"), "optimizer",
             r"^optimizer 'sgdd' names no Keras optimizer"),
            ("trainer.loss reassigned", lambda: setattr(self.trainer, "loss", "mse"),
             "trainer.loss", r"^trainer.loss cannot be changed once the trainer is built",
             {"error": AttributeError}),
            ("metrics a metric of one value", lambda: _trainer(metrics=[keras.metrics.Mean()]),
             "metrics", r"^metrics entry Mean is a metric of one value \(update_state"
                        r"\(values\)\); compile's metrics are called with \(y_true, y_pred\)"),
            ("optimizer a class", lambda: towers.TowerTrainer(
                reference.make_model(), reference.make_loss(), keras.optimizers.SGD),
             "optimizer", r"^optimizer must be .*, got type"),
            ("loss an unknown name", lambda: _trainer(loss="no_such_loss"), "loss",
             r"^loss 'no_such_loss' is not a Keras loss name"),
            ("loss a number", lambda: _trainer(loss=42), "loss",
             r"^loss must be a keras.losses.Loss, a loss name or a callable"),
            ("loss an empty list", lambda: towers.TowerTrainer(
                reference.make_model(), [], keras.optimizers.SGD(0.1), devices=DEVICES), "loss",
             r"^loss \[\] holds no loss"),
            ("loss a class", lambda: _trainer(loss=keras.losses.MeanSquaredError), "loss",
             r"^loss MeanSquaredError is a class; pass an instance"),
            ("loss_weights fewer than the losses", lambda: _two_loss_trainer(loss_weights=[1.0]),
             "loss_weights", r"^loss_weights holds 1 weight\(s\) but the loss 2 loss\(es\)"),
            ("loss_weights for an output the model lacks", lambda: _two_loss_trainer(
                loss_weights={"zz": 1.0}), "loss_weights",
             r"^loss_weights names \['zz'\], not outputs of the model"),
            ("metrics an unknown name", lambda: _trainer(metrics=["no_such_metric"]),
             "metrics", r"^metrics entry 'no_such_metric' is not a keras.metrics.Metric"),
            ("metrics a number", lambda: _trainer(metrics=[42]), "metrics",
             r"^metrics entry 42 is not"),
            ("weighted_metrics an unknown name", lambda: _trainer(weighted_metrics=["bogus"]),
             "weighted_metrics", r"^weighted_metrics entry 'bogus' is not"),
            ("devices empty", lambda: _trainer(devices=[]), "devices", r"^devices is empty"),
            ("devices one number", lambda: _trainer(devices=2), "devices",
             r"^devices must be a list of device names"),
            ("a device not a name", lambda: _trainer(devices=["banana"]), "device",
             r"^device 'banana' is not a device name"),
            ("a device a number", lambda: _trainer(devices=[0, 1]), "device",
             r"^device 0 names no device type"),
            ("a device that does not exist", lambda: _trainer(devices=["/device:CPU:9"]),
             "devices", r"^devices \['/device:CPU:9'\] do not exist; available devices"),
            ("a grid without pipeline_cuts", lambda: _trainer(devices=[DEVICES[:2]] * 2),
             "pipeline_cuts", r"^devices .* is a grid \(rows of devices\), which is for "
                              r"pipeline stages"),
            ("main_device not a name", lambda: _trainer(main_device="banana"), "device",
             r"^device 'banana' is not a device name"),
            ("main_device that does not exist", lambda: _trainer(main_device="/device:CPU:9"),
             "main_device", r"^main_device '/device:CPU:9' does not exist"),
            ("cluster not a Cluster", lambda: _trainer(cluster="x"), "cluster",
             r"^cluster must be a towers.Cluster .*, got str"),
            ("recompute 'stages' among layers", lambda: _trainer(recompute=["stages", "up"]),
             "recompute", r"^recompute=\['stages', 'up'\]: 'stages' recomputes every stage's "
                          r"whole forward and stands alone"),
            ("split layers and XLA", lambda: _trainer(split_model, devices=STAGE_DEVICES,
                                                      jit_compile=True),
             "jit_compile", r"^jit_compile=True cannot compile split layers yet"),
            ("split layers and replicated variables", lambda: _trainer(
                split_model, devices=STAGE_DEVICES, variable_placement="replicated"),
             "variable_placement", r"^variable_placement='replicated' cannot be combined "
                                   r"with split layers"),
            ("split layers, a row of another width", lambda: _trainer(
                split_model, devices=[DEVICES]), "devices",
             r"^devices .* must be a flat list .* or a grid of rows of 2 devices, one per "
             r"part"),
        ])

    def test_pipeline_cuts(self):
        def cut(cuts, model=None, **kwargs):
            kwargs.setdefault("devices", [DEVICES[:len(cuts) + 1]])
            return lambda: _trainer(model or reference.make_up_down_model(),
                                    pipeline_cuts=cuts, **kwargs)

        self.assert_all_refused([
            ("an unknown layer", cut(["nope"]), "pipeline cut",
             r"^pipeline cut 'nope' is not the name of a layer of model .*; its layers are "),
            ("out of order", cut(["down", "up"]), "pipeline cuts",
             r"^pipeline cuts \['down', 'up'\] are not in the order of the model's layers"),
            ("a layer twice", cut(["up", "up"]), "pipeline cuts", r"name a layer twice"),
            ("after the last layer", cut(["out"]), "pipeline cuts",
             r"leave stage 1 of model .* without layers"),
            ("a subclassed model", cut(["dense"], reference.subclassed_model()), "model",
             r"is a subclassed keras.Model: its call\(\) is Python code"),
            ("with replicated variables", cut(["up"], variable_placement="replicated"),
             "pipeline_cuts", r"^variable_placement='replicated' cannot be combined with "
                              r"pipeline_cuts"),
            ("with a main_device", cut(["up"], main_device="/device:CPU:0"), "main_device",
             r"^main_device cannot be combined with pipeline_cuts"),
            ("a flat list of devices", cut(["up"], devices=DEVICES), "devices",
             r"^with pipeline_cuts, devices must be a grid"),
            ("rows of another width", cut(["up"], devices=[DEVICES]), "devices",
             r"^every row of devices needs 2 devices, one per pipeline stage"),
        ])

    def test_losses_and_metrics_that_do_not_fit_the_outputs(self):
        # Refused at the first batch, before its step is traced.
        targets = {"cls": self.y, "value": self.y[:, None].astype("float32")}
        refused_at_first_batch = [
            ("a loss for an output the model lacks",
             _trainer(_two_outputs(), {"cls": reference.make_loss(), "zz": "mse"}),
             (self.x, targets), "loss", r"^the loss does not fit the model's outputs: .*'zz'"),
            ("metrics for an output the model lacks", _two_loss_trainer(metrics={"zz": ["mae"]}),
             (self.x, targets), "metrics", r"^the metrics do not fit the model's outputs: "
                                           r".*extra key\(s\): \['zz'\]"),
            ("targets for an output the model lacks", _two_loss_trainer(),
             (self.x, {"cls": self.y, "zz": targets["value"]}), "y",
             r"^y has key\(s\) \['zz'\], which name no output of model"),
            ("three targets for two outputs", _two_loss_trainer(),
             (self.x, (self.y, self.y, self.y)), "y",
             r"^y, shapes \(\(8,\), \(8,\), \(8,\)\), does not fit the loss"),
            ("labels beyond the classes", _trainer(), (self.x, self.y + 5), "y",
             r"^y, shape \(8,\), does not fit the loss .*Received a label value of \d+ "
             r"which is outside the valid range of \[0, 3\)"),
            ("fractional class ids", _trainer(), (self.x, self.y + 0.5), "labels",
             r"^the labels of a sparse categorical crossentropy loss are float\d+ and hold "
             r"\d.5, not a class id"),
            ("AUC on 3-class logits", _trainer(metrics=[keras.metrics.AUC()]),
             (self.x, self.y), "metrics", r"^the metrics do not fit the model's outputs: "
                                          r"metric 'auc' \(AUC\) on labels of shape \(\) and "
                                          r"outputs of shape \(3,\) per example"),
            ("an integer output", _trainer(_integer_output(), "mse"),
             (self.x, np.zeros((8, 3), "float32")), "gradient",
             r"^no trainable weight of model .* gets a gradient from the loss: the model's "
             r"outputs are \['int32'\]"),
        ]
        self.assert_all_refused([
            (description, lambda trainer=trainer, batch=batch: trainer.train_step(batch),
             argument, message, {"trainer": trainer})
            for description, trainer, batch, argument, message in refused_at_first_batch])

    def test_train_step_batches(self):
        step = self.trainer.train_step
        x, y, w = self.x, self.y, self.w
        not_a_batch = r"^a batch must be \(x, y\) or \(x, y, sample_weight\), got a "
        self.assert_all_refused([
            ("None", lambda: step(None), "batch", not_a_batch + "NoneType"),
            ("x alone in a tuple", lambda: step((x,)), "batch", not_a_batch + "tuple of length 1"),
            ("four parts", lambda: step((x, y, w, w)), "batch", not_a_batch + "tuple of length 4"),
            ("x alone", lambda: step(x), "batch", not_a_batch + "ndarray"),
            ("a dict", lambda: step({"x": x, "y": y}), "batch", not_a_batch + "dict"),
            ("y None", lambda: step((x, None)), "y", r"^y is None; every field of a batch"),
            ("x None", lambda: step((None, y)), "x", r"^x is None; every field of a batch"),
            ("fewer labels than rows", lambda: step((x, y[:7])), "batch",
             r"^the fields of the batch disagree on batch size \(dim 0\): \(\(8, 5\), \(7,\)\)"),
            ("fewer sample weights than rows", lambda: step((x, y, w[:7])), "sample weights",
             r"disagree on batch size .*sample weights need one row per example"),
            ("no rows", lambda: step((x[:0], y[:0])), "batch", r"^the batch is empty"),
            ("a scalar x", lambda: step((np.float32(1), y)), "batch",
             r"^every field of a batch needs a batch dimension \(dim 0\)"),
            ("strings for x", lambda: step((np.full((8, 5), "a"), y)), "x",
             r"^model .* failed on x, shape \(8, 5\): Cast string to float"),
            ("strings for y", lambda: step((x, np.full(8, "a"))), "y",
             r"^y, shape \(8,\), does not fit the loss"),
            ("two labels per row", lambda: step((x, np.stack([y, y], 1))), "y",
             r"^y, shape \(8, 2\), does not fit the loss"),
            ("two sample weights per row", lambda: step((x, y, np.ones((8, 2), "float32"))),
             "sample_weight", r"^sample_weight, shape \(8, 2\), does not fit the loss: weights "
                              r"of shape \(None, 2\) for loss values of shape \(None,\)"),
            ("strings for sample weights", lambda: step((x, y, np.full(8, "a"))),
             "sample_weight", r"^sample_weight, shape \(8,\), does not fit the loss"),
            ("a SparseTensor x", lambda: step((tf.sparse.from_dense(x), y)), "x",
             r"^x holds a SparseTensor"),
            ("shards for another number of towers", lambda: step(split.Shards([(x, y)] * 2)),
             "shards", r"^the batch comes in 2 shards but the step has 3 towers"),
            ("fractional labels after integer ones", lambda: step((x, y + 0.5)), "labels",
             r"^the labels of a sparse categorical crossentropy loss are float32 and hold "
             r"\d.5, not a class id"),
            ("fractional labels after whole float ones", lambda: step((x, y + 0.5, w)),
             "labels", r"^the labels of a sparse categorical crossentropy loss hold \d.5, not "
                       r"a class id"),
            ("data_ended without a cluster", lambda: step((x, y), data_ended=True),
             "data_ended", r"^data_ended=True is for a worker of a cluster"),
        ])

    def test_train_steps_and_evaluate_arguments(self):
        trainer, x, y = self.trainer, self.x, self.y
        narrow = tf.data.Dataset.from_tensor_slices((x[:, :4], y)).batch(4)
        empty_first = tf.data.Dataset.from_tensors((x[:0], y[:0])).concatenate(self.dataset)
        fractional = tf.data.Dataset.from_tensor_slices((x, y + 0.5)).batch(4)
        self.assert_all_refused([
            ("train_steps on an empty batch", lambda: trainer.train_steps(
                iter(empty_first), 2), "batch",
             r"^the batch is empty \(batch size 0\): batch 1 of this call of train_steps; .*"
             r"The 0 step\(s\) before it were applied"),
            ("train_steps on fractional labels", lambda: trainer.train_steps(
                iter(fractional), 2), "labels",
             r"^the labels of a sparse categorical crossentropy loss hold \d.5, not a class id"),
            ("train_steps on a list", lambda: trainer.train_steps([(x, y)], 1), "iterator",
             r"^iterator must be a tf.data iterator .*, got a list"),
            ("train_steps on a dataset", lambda: trainer.train_steps(self.dataset, 1),
             "iterator", r"^iterator must be a tf.data iterator \(iter\(dataset\)\)"),
            ("train_steps num_steps a string", lambda: trainer.train_steps(
                iter(self.dataset), "2"), "num_steps", r"^num_steps must be an integer >= 1"),
            ("train_steps num_steps None", lambda: trainer.train_steps(
                iter(self.dataset), None), "num_steps", r"^num_steps must be an integer >= 1"),
            ("train_steps a dataset of another width", lambda: trainer.train_steps(
                iter(narrow), 1), "x",
             r"^x has shape \(None, 4\) but model .* takes inputs of shape \(None, 5\)"),
            ("shard_iterator of a list", lambda: trainer.shard_iterator([(x, y)]),
             "Dataset", r"^ShardIterator needs a tf.data.Dataset, got list"),
            ("shard_iterator buffer_size 0", lambda: trainer.shard_iterator(
                self.dataset, buffer_size=0), "buffer_size", r"^buffer_size must be an integer"),
            ("evaluate None", lambda: trainer.evaluate(None), "x",
             r"^x must be arrays with y, a tf.data.Dataset or an iterable of .* batches; "
             r"got x=None"),
            ("evaluate a number", lambda: trainer.evaluate(3), "x",
             r"^x must be arrays with y, .*; got x=int"),
            ("evaluate no batches", lambda: trainer.evaluate([]), "batches",
             r"^evaluate got no batches"),
            ("evaluate an empty dataset", lambda: trainer.evaluate(self.dataset.take(0)),
             "batches", r"^evaluate got no batches"),
            ("evaluate x alone", lambda: trainer.evaluate(x), "y",
             r"^x is arrays and y is None: give y"),
            ("evaluate y None", lambda: trainer.evaluate((x, None)), "y",
             r"^x is arrays and y is None"),
            ("evaluate fewer labels than rows", lambda: trainer.evaluate((x, y[:7])), "sizes",
             r"^x: Data cardinality is ambiguous. .*'x' sizes: 8 'y' sizes: 7"),
            ("evaluate one-hot labels", lambda: trainer.evaluate(
                (x, np.eye(3, dtype="float32")[y])), "y", r"^y, shape \(8, 3\), does not fit"),
            ("evaluate fractional labels after whole float ones", lambda: trainer.evaluate(
                (x, y + 0.5, self.w)), "labels",
             r"^the labels of a sparse categorical crossentropy loss hold \d.5, not a class id"),
            ("evaluate a dataset of another width", lambda: trainer.evaluate(narrow), "x",
             r"^x has shape \(4, 4\) but model .* takes inputs of shape \(None, 5\)"),
        ])

    def test_fit_arguments(self):
        fit, x, y = self.trainer.fit, self.x, self.y
        batches = [(x, y)]
        two = _two_loss_trainer()
        other_model = towers.Checkpointer(os.path.join(self.directory, "other_model"),
                                          reference.make_model(), keras.optimizers.SGD())
        other_optimizer = towers.Checkpointer(os.path.join(self.directory, "other_optimizer"),
                                              self.trainer.model, keras.optimizers.SGD())
        cases = [(f"{name}={value!r}", lambda name=name, value=value: fit(
            batches, **{name: value}), name, rf"^{name} must be an integer >= 1, got")
            for name, values in {"epochs": [0, 1.5, "2"],
                                 "steps_per_epoch": [0, 2.5],
                                 "max_steps": [0]}.items() for value in values]
        cases += [(f"verbose={value!r}", lambda value=value: fit(batches, verbose=value),
                   "verbose", r"^verbose must be 'auto', 0 \(silent\), 1 \(a progress bar\) or "
                              r"2 \(log lines\)") for value in ("loud", 3)]
        cases += [("x a generator function of no epoch", lambda: fit(_one_batch), "x",
                   r"^x is a callable that takes no epoch: fit calls x\(epoch\)")]
        cases += [(f"x {value!r}", lambda value=value: fit(value), "x",
                   r"^x must be arrays with y, a tf.data.Dataset or an iterable of .* batches, "
                   r"or a callable epoch -> one of those; got x=") for value in (None, 42)]
        self.assert_all_refused(cases + [
            ("epochs=None", lambda: fit(batches, epochs=None), "epochs",
             r"^epochs must be an integer >= 1, got None"),
            ("validation_data empty", lambda: fit(batches, validation_data=[]),
             "validation_data", r"^validation_data has no batches"),
            ("validation_data a number", lambda: fit(batches, validation_data=3),
             "validation_data", r"^validation_data must be arrays with y, .*; got x=int"),
            ("checkpointer a folder", lambda: fit(batches, checkpointer="dir"), "checkpointer",
             r"^checkpointer must be a towers.Checkpointer\(directory, trainer.model, "
             r"trainer.optimizer\), got str"),
            ("log_dir a file", lambda: fit(batches, log_dir=self.a_file), "log_dir",
             r"^log_dir=.* cannot hold TensorBoard summaries: Not a directory"),
            ("validation_data x alone", lambda: fit(batches, validation_data=(x,)),
             "validation_data", r"^validation_data is arrays and y is None: give y"),
            ("validation_data a string", lambda: fit(batches, validation_data="val"),
             "validation_data", r"^validation_data must be arrays with y, .*; got x=str"),
            ("validation_data fewer labels than rows", lambda: fit(
                batches, validation_data=(x, y[:7])), "validation_data",
             r"^validation_data: Data cardinality is ambiguous. .*'x' sizes: 8 'y' sizes: 7"),
            ("callbacks a string", lambda: fit(batches, callbacks="x"), "callbacks",
             r"^callbacks must be keras.callbacks.Callback objects, got str"),
            ("callbacks of a number", lambda: fit(batches, callbacks=[42]), "callbacks",
             r"^callbacks must be keras.callbacks.Callback objects, got int"),
            ("callbacks of a class", lambda: fit(
                batches, callbacks=[keras.callbacks.EarlyStopping]), "callbacks",
             r"^callbacks must be keras.callbacks.Callback objects, got type"),
            ("class_weight a list", lambda: fit(batches, class_weight=[1.0, 2.0, 1.0]),
             "class_weight", r"^class_weight must be a dict of class index -> weight"),
            ("class_weight by name", lambda: fit(batches, class_weight={"cat": 1.0}),
             "class_weight", r"^class_weight must be a dict .*, got \{'cat': 1.0\}"),
            ("class_weight with sample weights", lambda: fit(
                [(x, y, self.w)], class_weight={0: 1.0}), "class_weight",
             r"cannot `class_weight` and `sample_weight` at the same time"),
            ("class_weight for two outputs", lambda: two.fit(
                [(x, {"cls": y, "value": y})], class_weight={0: 1.0}), "class_weight",
             r"`class_weight` is only supported for Models with a single output",
             {"trainer": two}),
            ("a batch with fewer labels than rows", lambda: fit([(x, y[:7])]), "batch",
             r"^the fields of the batch disagree on batch size"),
            ("a checkpointer of another model", lambda: fit(batches, checkpointer=other_model),
             "checkpointer", r"^checkpointer is bound to model .*, not to the trainer's"),
            ("a checkpointer of another optimizer", lambda: fit(
                batches, checkpointer=other_optimizer), "checkpointer",
             r"^checkpointer is bound to optimizer .*, not to the trainer's"),
        ])

    def test_the_algorithm_s_pieces(self):
        x, y = self.x, self.y
        grads = [[tf.ones(2)], [tf.ones(2)]]
        model, loss = reference.make_model(), reference.make_loss()
        cases = [(f"split_batch num_shards={value!r}",
                  lambda value=value: towers.split_batch((x, y), value), "num_shards",
                  r"^num_shards must be an integer >= 1") for value in (0, 1.5)]
        self.assert_all_refused(cases + [
            ("split_batch of a string", lambda: towers.split_batch("abc", 2), "batch",
             r"^every field of a batch needs a batch dimension"),
            ("split_batch of parts of other sizes", lambda: towers.split_batch((x, y[:7]), 2),
             "batch", r"^the fields of the batch disagree on batch size"),
            ("split_batch of nothing", lambda: towers.split_batch((), 2), "batch",
             r"^the batch holds no tensors"),
            ("split_batch of None", lambda: towers.split_batch(None, 2), "batch",
             r"^the batch is None"),
            ("average_gradients of no towers", lambda: towers.average_gradients([]),
             "tower_grads", r"^tower_grads must be a non-empty list"),
            ("average_gradients of a tensor", lambda: towers.average_gradients(tf.ones([2, 3])),
             "tower_grads", r"^tower_grads must be a non-empty list"),
            ("average_gradients, lists of other lengths", lambda: towers.average_gradients(
                [[tf.ones(2)], [tf.ones(2), tf.ones(2)]]), "tower",
             r"^every tower must give one gradient per variable.* lengths \[1, 2\]"),
            ("average_gradients, a weight short", lambda: towers.average_gradients(
                grads, weights=[1.0]), "weights", r"^got 1 weights for 2 towers"),
            ("average_gradients, a negative weight", lambda: towers.average_gradients(
                grads, weights=[1.0, -1.0]), "weights", r"^weights must be non-negative"),
            ("average_gradients, device not a name", lambda: towers.average_gradients(
                grads, device="banana"), "device", r"^device 'banana' is not a device name"),
            ("average_gradients, towers' shapes differ", lambda: towers.average_gradients(
                [[tf.ones(2)], [tf.ones(3)]]), "gradients of variable 0",
             r"^the towers' gradients of variable 0 have shapes \[\(2,\), \(3,\)\]"),
            ("average_gradients of strings", lambda: towers.average_gradients([["a"], ["b"]]),
             "gradient 0", r"^tower 0's gradient 0 is a str; give a Tensor"),
            ("tower_gradients, one device name", lambda: towers.tower_gradients(
                model, loss, (x, y), "/device:CPU:0"), "devices",
             r"^devices must be a list of device names"),
            ("tower_gradients, model a name", lambda: towers.tower_gradients(
                "mlp", loss, (x, y), DEVICES), "model", r"^model must be a keras.Model, got str"),
            ("tower_gradients, devices a grid", lambda: towers.tower_gradients(
                model, loss, (x, y), [DEVICES[:2]] * 2), "devices",
             r"is a grid .*: give a flat list, one device per tower"),
            ("tower_gradients, x alone", lambda: towers.tower_gradients(
                model, loss, (x,), DEVICES), "batch", r"^a batch must be \(x, y\)"),
            ("tower_gradients, an unknown loss", lambda: towers.tower_gradients(
                model, "bogus", (x, y), DEVICES), "loss", r"^loss 'bogus' is not a Keras loss"),
            ("tower_gradients, main_device not a name", lambda: towers.tower_gradients(
                model, loss, (x, y), DEVICES, main_device="banana"), "device",
             r"^device 'banana' is not a device name"),
        ])

    def test_documented_answers_that_are_not_mistakes(self):
        # docs/api.md: "if every weight is 0 the result is all zeros" (every tower empty).
        averaged = towers.average_gradients([[tf.ones(2)], [tf.ones(2)]], weights=[0.0, 0.0])
        self.assertAllEqual(averaged[0], [0.0, 0.0])

    def test_configure_devices(self):
        configure = towers.configure_devices
        cases = [(f"num_towers={value!r}", lambda value=value: configure(value), "num_towers",
                  r"^num_towers must be an integer >= 1") for value in (0, "2")]
        cases += [(f"memory_limit_mb={value!r}", lambda value=value: configure(
            2, "cpu", memory_limit_mb=value), "memory_limit_mb",
            r"^memory_limit_mb must be a positive integer \(MiB\) or None")
            for value in (-1, "x")]
        self.assert_all_refused(cases + [
            ("device_type tpu", lambda: configure(2, "tpu"), "device_type",
             r"^device_type must be one of \('auto', 'gpu', 'cpu'\), got 'tpu'"),
            ("more CPU devices once started", lambda: configure(8, "cpu"), "configure_devices",
             r"^TensorFlow's runtime already started with \d+ CPU device\(s\), so 8 towers",
             {"error": towers.DeviceConfigError}),
        ])

    def test_checkpointer_arguments(self):
        def checkpointer(folder="checkpoints", **kwargs):
            return lambda: towers.Checkpointer(os.path.join(self.directory, folder),
                                               self.trainer.model, self.trainer.optimizer,
                                               **kwargs)

        cases = [(f"every_steps={value!r}", checkpointer(every_steps=value), "every_steps",
                  r"^every_steps must be an integer >= 1, got")
                 for value in (0, 1.5)]
        self.assert_all_refused(cases + [
            ("a directory under a file", checkpointer(os.path.join(self.a_file, "ckpt")),
             "checkpoints", r"^cannot write checkpoints to .*: Not a directory"),
            ("max_to_keep 0", checkpointer(max_to_keep=0), "max_to_keep",
             r"positive integer or `None` for `max_to_keep`, got 0"),
            ("directory None", lambda: towers.Checkpointer(
                None, self.trainer.model, self.trainer.optimizer), "directory",
             r"^directory must be a folder path \(a str\), got NoneType"),
            ("model a name", lambda: towers.Checkpointer(
                self.directory, "mlp", self.trainer.optimizer), "model",
             r"^model must be a keras.Model, got str"),
            ("optimizer a name", lambda: towers.Checkpointer(
                self.directory, self.trainer.model, "sgd"), "optimizer",
             r"^optimizer must be a keras.optimizers.Optimizer, got str"),
        ])

    def test_split_model_cuts(self):
        def cut(cuts, model=None):
            return lambda: towers.split_model(model or reference.make_up_down_model(), cuts)

        self.assert_all_refused([
            ("not a model", cut(["up"], "mlp"), "model",
             r"^model must be a functional or Sequential keras.Model, got str"),
            ("one name, not a list", cut("up"), "cuts", r"^cuts must be a list of layer names"),
            ("None", cut(None), "cuts", r"^cuts must be a list of layer names, got None"),
            ("an unknown layer", cut(["nope"]), "pipeline cut",
             r"^pipeline cut 'nope' is not the name of a layer"),
            ("a number", cut([1]), "pipeline cut", r"^pipeline cut 1 is not the name"),
            ("a layer twice", cut(["up", "up"]), "pipeline cuts", r"name a layer twice"),
            ("out of order", cut(["down", "up"]), "pipeline cuts", r"are not in the order"),
            ("after the last layer", cut(["out"]), "pipeline cuts", r"without layers"),
            ("a subclassed model", cut(["dense"], reference.subclassed_model()), "model",
             r"is a subclassed keras.Model"),
        ])

    def test_split_layers_plans(self):
        def split(plan, devices=DEVICES[:2], model=None):
            return lambda: towers.split_layers(model or self.up_down, plan, devices)

        unbuilt = keras.Sequential([keras.layers.Dense(2, name="d")])
        narrow = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, name="d")])
        embedding = keras.Sequential([keras.Input((3,), dtype="int32"),
                                      keras.layers.Embedding(10, 4, name="e")])
        self.assert_all_refused([
            ("an unknown layer", split({"nope": "column"}), "plan",
             r"^plan names layer 'nope', which model .* does not have; its layers are "),
            ("an unknown kind", split({"up": "diagonal"}), "plan",
             r"^plan\['up'\] = 'diagonal' is not a kind; use one of \['column', 'heads', "),
            ("vocab for a Dense", split({"up": "vocab"}), "plan",
             r"^plan\['up'\] = 'vocab' splits Embedding layers, but 'up' is Dense"),
            ("row for an Embedding", split({"e": "row"}, model=embedding), "plan",
             r"^plan\['e'\] = 'row' splits Dense or EinsumDense layers, but 'e' is Embedding"),
            ("heads for a Dense", split({"down": "heads"}), "plan",
             r"splits MultiHeadAttention layers, but 'down' is Dense"),
            ("a device index out of range", split({"up": 5}), "plan",
             r"^plan\['up'\] = 5 is not a device index: there are 2 devices"),
            ("a fraction", split({"up": 1.5}), "plan", r"^plan\['up'\] must be one of .*got 1.5"),
            ("True", split({"up": True}), "plan", r"^plan\['up'\] must be one of .*got True"),
            ("an empty plan", split({}), "plan", r"^plan must be a non-empty dict"),
            ("a kind, not a plan", split("column"), "plan", r"^plan must be a non-empty dict"),
            ("more parts than units", split({"d": "column"}, DEVICES, narrow), "plan",
             r"^plan\['d'\] = 'column' splits 2 output units into 3 parts"),
            ("no devices", split({"up": "column"}, []), "devices",
             r"^devices must name at least one device"),
            ("one device name", split({"up": "column"}, "/device:CPU:0"), "devices",
             r"^devices must be a list of device names, one per part"),
            ("a device not a name", split({"up": "column"}, ["banana", "x"]), "device",
             r"^device 'banana' is not a device name"),
            ("devices that do not exist", split({"up": "column"}, ["/device:CPU:8",
                                                                     "/device:CPU:9"]),
             "devices", r"^devices \['/device:CPU:8', '/device:CPU:9'\] do not exist"),
            ("an unbuilt model", split({"d": "column"}, model=unbuilt), "model",
             r"^model .* is not built"),
            ("a subclassed model's attribute name, not its layer's",
             split({"dense": "column"}, model=reference.subclassed_model()), "plan key",
             r"^plan key 'dense' matches no layer"),
            ("join_layers of a name", lambda: towers.join_layers("mlp"), "join_layers",
             r"^join_layers takes the keras.Model split_layers returned, got str"),
        ])


QUICK_FLAGS = ("--model=mlp", "--num_towers=2", "--global_batch_size=8")
# (bad flags, the flag named, a regex of the line). absl refuses a value out of a flag's
# type, range or list as it parses; towers-train refuses the rest before any training.
BAD_FLAGS = [
    ("--num_towers=-1", "--num_towers", r"-1 is not an integer in the range \[1, 256\]"),
    ("--num_towers=two", "--num_towers", r"invalid literal for int\(\)"),
    ("--global_batch_size=0", "--global_batch_size", r"0 is not a positive integer"),
    ("--steps=0", "--steps", r"0 is not a positive integer"),
    ("--epochs=0", "--epochs", r"0 is not a positive integer"),
    ("--epochs=1", "epochs", r"At most one of \(epochs, steps\)"),
    ("--optimizer=foo", "--optimizer", r"value should be one of <adam\|sgd>"),
    ("--dataset=foo", "--dataset", r"value should be one of <digits\|synthetic"),
    ("--learning_rate=-1", "--learning_rate", r"not a non-negative number"),
    ("--learning_rate=nan", "--learning_rate", r"must be a finite number \(not nan or inf\)"),
    ("--learning_rate=inf", "--learning_rate", r"must be a finite number \(not nan or inf\)"),
    ("--clip_global_norm=0", "--clip_global_norm", r"a global norm of 0 would clip every "
                                                   r"gradient to zero; .*leave the flag out"),
    ("--checkpoint_dir=", "--checkpoint_dir", r"flag --checkpoint_dir=: an empty path"),
    ("--output_json=", "--output_json", r"flag --output_json=: an empty path"),
    ("--seed=-1", "--seed", r"-1 is not an integer in the range \[0, 4294967295\]"),
    ("--recompute=stages,logits", "--recompute", r"'stages' .* stands alone; give either "
                                                 r"--recompute=stages or layer names"),
    ("--num_towers=1000", "--num_towers", r"1000 is not an integer in the range \[1, 256\]"),
    ("--intra_op_threads=100000", "--intra_op_threads",
     r"100000 is not an integer in the range \[0, 1024\]"),
    ("--split_plan=logits:column", "--split_plan",
     r"--split_plan splits layers into --num_parts=T parts .*give --num_parts=2 or more"),
    ("--num_parts=2 --split_plan=logits:column,logits:row", "--split_plan",
     r"names layer 'logits' twice \(logits:column and logits:row\)"),
    ("--aggregation=foo", "--aggregation", r"one of <main\|tree\|collective\|nccl>"),
    ("--variable_placement=foo", "--variable_placement", r"one of <main\|replicated\|spread>"),
    ("--accum_steps=0", "--accum_steps", r"0 is not a positive integer"),
    ("--steps_per_execution=0", "--steps_per_execution", r"0 is not a positive integer"),
    ("--prefetch_to_devices=maybe", "--prefetch_to_devices", r"one of <auto\|on\|off>"),
    ("--pipeline_schedule=foo", "--pipeline_schedule", r"one of <gpipe\|1f1b>"),
    ("--mixed_precision=float8", "--mixed_precision", r"one of <none\|mixed_float16"),
    ("--clip_global_norm=-1", "--clip_global_norm", r"not a non-negative number"),
    ("--checkpoint_every=0", "--checkpoint_every", r"0 is not a positive integer"),
    ("--intra_op_threads=-1", "--intra_op_threads", r"-1 is not an integer in the range "
                                                    r"\[0, 1024\]"),
    ("--num_parts=0", "--num_parts", r"0 is not a positive integer"),
    # --tensor_parallel, --num_parts's alias for a release: its line names the flag typed.
    ("--tensor_parallel=0", "--tensor_parallel", r"flag --tensor_parallel=0: 0 is not a "
                                                 r"positive integer"),
    ("--device_type=tpu", "--device_type", r"one of <auto\|gpu\|cpu>"),
    ("--jit_compile=maybe", "--jit_compile", r"Non-boolean argument to boolean flag"),
    ("--peer_timeout_s=0", "--peer_timeout_s", r"is not number >= 1.0"),
    ("--no_such_flag=1", "no_such_flag", r"Unknown command line flag"),
    ("steps=3", "unexpected arguments", r"unexpected arguments 'steps=3': every setting is a "
                                        r"flag"),
    ("--model=nonexistent.module:fn", "--model",
     r"cannot import module 'nonexistent.module': ModuleNotFoundError"),
    ("--model=examples.my_model:no_such_fn", "--model",
     r"module 'examples.my_model' .* has no function 'no_such_fn'"),
    ("--model=/no/such.keras", "--model", r"model file '/no/such.keras' does not exist"),
    ("--model=foo:bar:baz", "--model", r"model 'foo:bar:baz' is none of the three forms"),
    ("--pipeline_stages=2 --variable_placement=replicated", "--pipeline_stages",
     r"cannot be combined with --variable_placement=replicated"),
    ("--pipeline_stages=2 --split_plan=logits:column", "--pipeline_stages",
     r"with --split_plan needs --num_parts=T \(alias --tensor_parallel\), the parts of each "
     r"stage"),
    ("--num_parts=2 --split_plan=logits", "--split_plan", r"'logits' is not LAYER:KIND"),
    ("--num_parts=2 --split_plan=:column", "--split_plan", r"':column' is not LAYER:KIND"),
    ("--num_parts=2 --split_plan=logits:diagonal", "--split_plan",
     r"plan\['logits'\] = 'diagonal' is not a kind"),
    ("--num_parts=2 --split_plan=nope:column", "--split_plan",
     r"plan names layer 'nope', which model"),
    ("--num_parts=2 --split_plan=images:column", "--split_plan",
     r"splits Dense or EinsumDense layers, but 'images' is InputLayer"),
    ("--num_parts=2 --split_plan=logits:7", "--split_plan",
     r"plan\['logits'\] = 7 is not a device index: there are 2 devices"),
    ("--num_parts=2 --model=cnn", "--num_parts", r"model 'cnn' has no default split plan"),
    ("--tensor_parallel=2 --model=cnn", "--tensor_parallel",
     r"--num_parts=2 \(alias --tensor_parallel\): model 'cnn' has no default split plan"),
    ("--task_index=0", "--task_index", r"--task_index needs --worker_hosts"),
    ("--worker_hosts=localhost:1", "--worker_hosts", r"needs --task_index"),
]


class CommandLineProbeTest(tf.test.TestCase):
    """towers-train, in this process: a non-zero exit and one line naming the flag."""

    def setUp(self):
        super().setUp()
        self.directory = self.create_tempdir().full_path
        self.output = os.path.join(self.directory, "out.json")
        self.a_file = os.path.join(self.directory, "a_file")
        open(self.a_file, "w").close()

    def assert_refused(self, flags_given, flag, message):
        status, stderr = _main_in_process(*QUICK_FLAGS, "--steps=1",
                                          f"--output_json={self.output}", *flags_given)
        self.assertNotEqual(status, 0)
        lines = [line for line in stderr.splitlines() if flag in line]
        self.assertLen(lines, 1, stderr[-2000:])
        self.assertRegex(lines[0], message)
        self.assertNotIn("Traceback", stderr)
        self.assertFalse(os.path.exists(self.output))

    def test_bad_flags_exit_with_one_line_naming_them(self):
        for flags_given, flag, message in BAD_FLAGS:
            with self.subTest(flags_given):
                self.assert_refused(flags_given.split(), flag, message)

    def test_bad_paths_exit_with_one_line_naming_their_flag(self):
        under_a_file = os.path.join(self.a_file, "under")
        for flags_given, flag, message in [
            (f"--checkpoint_dir={under_a_file}", "--checkpoint_dir",
             r"cannot write checkpoints to .*: Not a directory"),
            (f"--log_dir={under_a_file}", "--log_dir",
             r"--log_dir=.*: cannot write in .*: Not a directory"),
            (f"--log_dir={self.a_file}", "--log_dir", r"--log_dir=.* is a file; give a folder"),
            (f"--data_npz={self.a_file}", "data_npz", r"is not a NumPy .npz archive"),
        ]:
            with self.subTest(flags_given):
                self.assert_refused([flags_given], flag, message)
                self.assertFalse(os.path.exists(under_a_file))


if __name__ == "__main__":
    tf.test.main()
