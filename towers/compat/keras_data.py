"""Private Keras names for fit's data, each beside the public alternative it stands in for
(towers/compat/__init__.py says why they live here)."""

from keras.src.trainers.data_adapters import array_data_adapter, array_slicing


def can_batch_arrays(arrays):
    """Whether every leaf of `arrays` (x, y, sample_weight: any nesting, None allowed) is
    an array Keras's fit batches itself: a NumPy array, a Tensor, a pandas frame, a list
    of numbers.

    Private: keras.src's array_data_adapter.can_convert_arrays, the test Keras's fit
    makes before batching. Public alternative: none; an isinstance test of our own would
    differ from Keras's on the forms it takes (pandas, SciPy sparse, JAX arrays).
    """
    return array_data_adapter.can_convert_arrays(arrays)


def array_batches(x, y, sample_weight, batch_size, shuffle, steps=None):
    """A tf.data.Dataset of the batches keras.Model.fit makes of arrays: (x, y) or
    (x, y, sample_weight) tuples (x alone, or (x,) for a list or tuple x, where y and
    sample_weight are None, as predict's) of `batch_size` rows (if None: the rows over
    `steps` batches, or 32), the last one partial, in the rows' order or (shuffle=True) in a new random order each time it is
    iterated (shuffle="batch": the batches' order). Its number of batches is
    `.num_batches` beside it: (dataset, num_batches).

    Private: keras.src's ArrayDataAdapter, fit's own; it checks that the arrays have as
    many rows as one another and says so in Keras's words. Public alternative:
    tf.data.Dataset.from_tensor_slices(...).shuffle(n).batch(batch_size), which copies
    the arrays into the graph and shuffles otherwise than Keras ("batch").
    """
    adapter = array_data_adapter.ArrayDataAdapter(
        x, y, sample_weight=sample_weight, batch_size=batch_size, steps=steps, shuffle=shuffle)
    return adapter.get_tf_dataset(), adapter.num_batches


def train_validation_split(arrays, validation_split):
    """(train arrays, validation arrays): the last `validation_split` of the rows held
    out, before any shuffle, as keras.Model.fit(validation_split=) holds them; a
    ValueError in Keras's words for data that is not arrays or too few rows.

    Private: keras.src's array_slicing.train_validation_split. Public alternative: none
    (slicing by hand would round the split differently from Keras at the edges).
    """
    return array_slicing.train_validation_split(arrays, validation_split)
