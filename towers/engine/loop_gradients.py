"""`tower_gradients`: the trainer's steps 1-5 for your own loop, which applies the
gradients itself (engine/step.py's run_towers on a StepSetup made for the call)."""

import dataclasses

import keras
import tensorflow as tf

from towers import devices as devices_lib
from towers.data_parallel import split
from towers.engine import losses, traced_tower
from towers.engine.options import TowerOptions
from towers.engine.step import StepSetup, assign_state, run_towers
from towers.model_parallel import stages as stages_lib


# Plain graph code with no Python control flow on tensors: nothing for autograph to
# convert, and converting StepSetup's generated __init__ reads the wrong source lines.
@tf.autograph.experimental.do_not_convert
def tower_gradients(model, loss, batch, devices, main_device=None, *, loss_scale=None,
                    cluster=None, **options):
    """Steps 1-5: the shard-weighted mean gradient of `loss` on the whole batch.

    Call it inside your own tf.function and apply the gradients yourself. The
    model's non-trainable state (BatchNorm statistics) is updated, as calling
    the model in training mode would.

    Args:
      model: a built keras.Model.
      loss: what keras.Model.compile takes as `loss` (a keras.losses.Loss, a
        name, a callable(y_true, y_pred) -> per-example losses, or a list or
        dict of them per output), or a losses.Objective.
      batch: (x, y) or (x, y, sample_weight), dim 0 = global batch, or its
        split.Shards (one per device). y may be None where `loss` is a callable
        that needs no labels (it then gets y_true=None).
      devices: tower device names, one shard each.
      main_device: where gradients are gathered and averaged; None = devices[0].
      options: accum_steps (micro-batches per shard, run one after another) and
        state_policy, as in TowerOptions; no other of its fields.
      loss_scale: None or a float32 scalar each tower multiplies its loss by
        (dynamic loss scaling); the gradients returned stay scaled.
      cluster: None, or a joined towers.Cluster: `batch` is then this worker's
        batch and the result is the global batch's mean,
        the same on every worker (towers.join_cluster first).

    Returns:
      (grads, logs): one gradient per model.trainable_variables entry, on
      main_device, and {"loss": scalar Tensor}.

    Raises:
      ValueError: as TowerTrainer: a model that is not a keras.Model, no devices, one
        that does not exist, a grid of devices, (without a cluster) a batch of no rows,
        or BatchNormalization(synchronized=True) layers that cannot meet (accum_steps,
        a cluster, towers sharing a device); nothing is computed.
    """
    unknown = sorted(set(options) - {"accum_steps", "state_policy"})
    if unknown:
        raise TypeError(f"tower_gradients got an unexpected keyword argument {unknown[0]!r}; "
                        "of TowerOptions' fields it takes accum_steps and state_policy.")
    options = TowerOptions(**options)
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
    devices = devices_lib.device_list(devices)
    if any(isinstance(device, (list, tuple)) for device in devices):
        raise ValueError(f"devices {devices} is a grid (rows of devices); tower_gradients "
                         "runs no pipeline stages: give a flat list, one device per tower.")
    mesh = devices_lib.mesh_of(devices, main_device=main_device)
    if not isinstance(batch, split.Shards):
        loss, batch = _without_labels(loss, batch)
    if cluster is None:
        split.check_not_empty(batch)
    setup = StepSetup(stages_lib.Stages(model), mesh, options, cluster=cluster)
    setup.statistics.check(options.micro_batches, jit_compile=False, cluster=cluster)
    if not isinstance(loss, losses.Objective):
        loss = losses.Objective(loss, output_names=getattr(model, "output_names", None))
    if (mesh.num_towers * options.micro_batches > 1 and not setup.statistics.layers
            and not tf.executing_eagerly()):
        # Inside the caller's tf.function the forward is traced once for every tower and
        # micro-batch. One call alone is traced plainly: a traced function's call and its
        # gradient cost more than they share. Eagerly nothing is traced. Global
        # BatchNorms meet inside the forward, so each tower's is traced apart.
        setup = dataclasses.replace(setup, compiled_tower=traced_tower.forwards_traced_once(
            setup.stages))
    result = run_towers(setup, loss, batch, loss_scale=loss_scale)
    assign_state(model, result.state)
    return result.grads, {"loss": result.loss}


def _without_labels(loss, batch):
    """(loss, batch) with y=None made a batch the step splits: a callable loss gets
    y_true=None, through a placeholder of no columns per row.

    Raises:
      ValueError: `batch` is not (x, y[, sample_weight]), or y is None for a loss
        that is not a plain callable (Keras's losses compare with labels).
    """
    x, y, sample_weight = split.unpack_batch(batch)
    if y is not None:
        return loss, batch
    if not callable(loss) or isinstance(loss, keras.losses.Loss):
        raise ValueError(f"y is None, which only a loss callable(y_true, y_pred) that needs no "
                         f"labels takes; {loss!r} compares with labels: give y.")
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    no_labels = tf.zeros([rows, 0])
    return (lambda y_true, y_pred: loss(None, y_pred)), (x, no_labels) + (
        () if sample_weight is None else (sample_weight,))
