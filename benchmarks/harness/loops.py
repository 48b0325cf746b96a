"""Your own loop's loss and its gradients, written three ways over the same towers, for
benchmarks/custom_step.py and benchmarks/loop_first_step.py. Each builder takes
(model, devices) and returns loss_and_grads(x, y) -> (the batch's mean loss, its
gradients w.r.t. model.trainable_variables), to be called inside a tf.function."""


def cross_entropy(y, logits):
    """Per-example sparse cross-entropy from logits, shape (n,)."""
    import keras
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def one_device(model, devices):
    """The reference: a GradientTape around the model on the whole batch, on devices[0]."""
    import tensorflow as tf

    def loss_and_grads(x, y):
        with tf.device(devices[0]), tf.GradientTape() as tape:
            loss = tf.reduce_mean(cross_entropy(y, model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)

    return loss_and_grads


def by_hand(model, devices):
    """The bare towers: per tower tf.device, a GradientTape, the model on its shard and
    its gradient; the sums on the main device."""
    import tensorflow as tf
    from towers.data_parallel import split

    def loss_and_grads(x, y):
        shards = split.split_batch((x, y), len(devices))
        losses, grads = [], []
        for device, (x_i, y_i) in zip(devices, shards):
            with tf.device(device), tf.GradientTape() as tape:
                loss = tf.reduce_sum(cross_entropy(y_i, model(x_i))) / x.shape[0]
            with tf.device(device):
                grads.append(tape.gradient(loss, model.trainable_variables))
            losses.append(loss)
        with tf.device(devices[0]):
            return tf.add_n(losses), [tf.add_n(list(g)) for g in zip(*grads)]

    return loss_and_grads


def with_tower_gradients(model, devices):
    import towers

    def loss_and_grads(x, y):
        grads, logs = towers.tower_gradients(model, cross_entropy, (x, y), devices)
        return logs["loss"], grads

    return loss_and_grads


def with_tower_step(model, devices):
    import towers

    def loss_and_grads(x, y):
        out = towers.tower_step(
            lambda tower, shard: ({"ce": cross_entropy(shard[1], tower(model, shard[0]))}, None),
            (x, y), devices, {"ce": model.trainable_variables})
        return out.losses["ce"], out.grads["ce"]

    return loss_and_grads
