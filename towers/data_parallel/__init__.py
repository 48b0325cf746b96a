"""Data parallelism: one shard of the batch per tower, the gradients met on a main device.

split (step 1: one shard per tower), replicas (2: the same weights on every
tower), aggregate and exchange (4-5: the towers' gradients gathered and summed by
a route chosen once; across workers too; the mean, clipping, the state merged),
collectives (the keyed all-reduce and all-gather ops), batch_statistics
(BatchNormalization's moments over the global batch, where rows meet). The
engine (towers.engine) runs them in the step.

May import: the shared modules only (devices, gradients, compat).
"""
