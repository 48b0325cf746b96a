"""Op parallelism: one layer's work split across devices, or whole layers placed on them.

layers (the parallel forms: ColumnDense, RowDense, VocabEmbedding, HeadsAttention,
Placed; each part runs forward and backward on its device), plan (`split_layers`,
checking a plan and rebuilding a model with its layers replaced; `join_layers`,
the way back), paths (plan keys as layer paths, nested layers replaced inside
their parents), grid (training a split model on towers x parts: the variables'
columns, each tower's row of part devices), tables (embedding look-ups where the
table lives), joined (a split model's checkpoints in the unsplit layout). Every
split is explicit, under `tf.device`, and exact: the split model computes the
same function as the original.

May import: towers.data_parallel (part sizes), towers.model_parallel (variable
groups), towers.devices, towers.errors.
"""
