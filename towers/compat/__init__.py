"""Every private Keras and TensorFlow name towers uses, each beside the public one it stands in for.

Checked on Keras 3.15.1 and TensorFlow 2.21.0 (constraints.txt). A Keras or
TensorFlow upgrade that moves one of these breaks this package only; each entry
says what it does, the public alternative, and why that does not serve.
Nothing else in towers imports keras.src or tensorflow.python, or reads a Keras
object's underscored attribute (tests/test_structure.py); the benchmarks' own such
names are in benchmarks/harness/compat.py.

Kept apart by what they lean on, so that an upgrade of one library is read in
one place: `keras_layers` (models, layers, variables, losses), `keras_graphs` (the
graph of layers a functional model runs), `keras_optimizers` (optimizers, Keras's
configuration), `tensorflow_runtime` (tf.data, the eager runtime, autograph, checkpoints),
`keras_data` (fit's arrays batched as Keras batches them), `keras_hub_layers`
(keras_hub's attention layers' projections).
Everything is used as `compat.<name>`.

Private behaviours elsewhere (no private name; they lean on how Keras works inside):
- training/placement.py step_hooks: sets update_hooks' and gather_hooks' attributes on
  the user's optimizer and tables while the step is traced, and puts back what was
  there (an instance's own, vars(owner)) on exit.
- training/recompute.py _call_recomputed: a layer instance's `call` replaced straight
  in its __dict__, past Keras's __setattr__, which would track the function.
- engine/tower_handle.py _TowerReads: a keras.StatelessScope whose get_current_value
  and add_update, which Keras's variables call when read or assigned, are the tower's.
"""

from towers.compat.keras_layers import (  # noqa: F401
    keras_mask, set_keras_mask, same_rank, CompileLoss, CompileMetrics, stateless_value,
    keras_call_state, loss_adders, nested_layers, batch_norm_moments,
    every_batch_norm_moments, sublayers, own_weights, replace_sublayer, move_variable,
    can_hold_in_slabs, hold_in_slabs, held_slabs, drop_weight, is_seed_state,
)
from towers.compat.keras_hub_layers import (  # noqa: F401
    rebuild_for_head_dim, rebuild_output_width, kernel_initializer_of, share_sublayers,
    keep_query_scale, output_projection, drop_output_bias,
)
from towers.compat.keras_graphs import (  # noqa: F401
    functional_graph, model_between, nodes_by_depth, runs_its_graph, run_graph,
)
from towers.compat.keras_data import (  # noqa: F401
    can_batch_arrays, array_batches, train_validation_split,
)
from towers.compat.keras_optimizers import (  # noqa: F401
    update_hooks, optimizer_knows, track_as_optimized, excluded_from_weight_decay,
    exclude_from_weight_decay_too, optimizer_variables, slots_for, add_optimizer_variables,
    keras_home_dir,
)
from towers.compat.tensorflow_runtime import (  # noqa: F401
    OwnedMultiDeviceIterator, eager_runtime, gather_hooks, attach, attached, saves_own_tensors,
    saved_variable_names, call_options_edited, current_call_config, calls_with,
    runtime_function, calling_instead, call_instead, graph_function_def, optimized_function,
    autograph_context, converted_as,
)
