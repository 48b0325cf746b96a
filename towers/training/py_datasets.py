"""A keras.utils.PyDataset in fit and evaluate: its epoch hooks called as Keras calls them.

keras.Model.fit resets its epoch iterator before the first epoch, which calls the
dataset's `on_epoch_end` once; then, each epoch, `on_epoch_begin` before the first batch
and `on_epoch_end` after the last one, before validation (not after an epoch that
stopped early). keras.Model.evaluate (fit's validation too) calls `on_epoch_end`, then
`on_epoch_begin` and `on_epoch_end` around its batches. A dataset that reshuffles in
`on_epoch_end` so trains on the same orders as under Keras's fit(shuffle=False): towers
reads the batches in their order.

Its batches are read one at a time in the training thread, so a PyDataset built to load
them in parallel (workers > 1, use_multiprocessing=True) is refused in one line rather
than run otherwise than asked.
"""

import keras


class EpochHooks:
    """The epoch hooks of fit's dataset where it is a PyDataset; nothing otherwise."""

    def __init__(self, dataset):
        """Raises ValueError, in one line, for a PyDataset that asks for parallel loading."""
        self.dataset = dataset if isinstance(dataset, keras.utils.PyDataset) else None
        if self.dataset is not None and (self.dataset.workers > 1
                                         or self.dataset.use_multiprocessing):
            raise ValueError(
                f"dataset {type(dataset).__name__} asks for workers={self.dataset.workers}, "
                f"use_multiprocessing={self.dataset.use_multiprocessing}; towers reads a "
                "PyDataset's batches one at a time in the training thread: build it with "
                "workers=1 and use_multiprocessing=False, or pass a tf.data.Dataset.")

    def before_fit(self):
        if self.dataset is not None:
            self.dataset.on_epoch_end()

    def epoch_begins(self):
        if self.dataset is not None:
            self.dataset.on_epoch_begin()

    def epoch_ends(self):
        if self.dataset is not None:
            self.dataset.on_epoch_end()
