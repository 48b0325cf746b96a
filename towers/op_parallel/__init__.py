"""Op parallelism: one layer's work split across devices, or whole layers placed on them.

layers (a split layer's parts: each runs forward and backward on its device), forms
and dense (the parallel forms: VocabEmbedding, HeadsAttention, Placed; ColumnDense,
RowDense), grouped (GroupedHeadsAttention: keras_hub's grouped-query attention
by key/value groups; grouped_classes: the classes it splits, why not the others), plan (`split_layers`, checking a plan and rebuilding a model with its
layers replaced; `join_layers`, the way back), paths (plan keys as layer paths,
nested layers replaced inside their parents), layouts (a keras LayoutMap read as a
plan), auto (plan="auto": Megatron's plan found in a transformer; auto_layouts: following a
backbone's get_layout_map), exactness (what a split would silently change, refused), vocab_loss (a sparse
cross-entropy of logits kept in parts: Megatron's vocab-parallel loss), grid (training a
split model on towers x (stages x) parts: where each part lives and each tower runs
it), tables (embedding look-ups where the table lives); training/checkpoint_twin.py
saves a split model's checkpoints in the unsplit layout. Every split is explicit,
under `tf.device`, and exact: the split model computes the same function as the
original.

May import: the shared modules only (devices, compat).
"""
