"""Op parallelism: one layer's work split across devices, or whole layers placed on them.

layers (the parallel forms: ColumnDense, RowDense, Placed), plan (`split_layers`,
checking a plan and rebuilding a model with its layers replaced; `join_layers`,
the way back). Every split is explicit, under `tf.device`, and exact: the split
model computes the same function as the original.

May import: towers.data_parallel (part sizes), towers.devices, towers.errors.
"""
