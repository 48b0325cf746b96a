"""The trainer: the step compiled, fed and looped.

trainer (`TowerTrainer`: options, checks, calling the compiled step), arguments (its
arguments as Keras users type them), placement (its devices as towers x stages x parts:
the step's set-up), compiled_steps (the bodies it compiles: the train step, steps 1-6, the
eval step and the predict step), overrides (a model overriding train_step or compute_loss
refused; predict_step refused by predict),
first_batch (building and checking on the first batch), compiled (one tf.function per
batch structure), executions (step 7: several steps per call, an in-graph loop), loop
(`fit`, `evaluate`), progress (fit's progress bar or log lines, TensorBoard summaries),
predict (`predict`: x in batches, every tower
its shard, the outputs in row order), py_datasets (a PyDataset's epoch hooks),
metrics, callbacks (Keras callbacks), checkpoint (`Checkpointer`), preemption
(SIGTERM/SIGINT finish the step and save), prefetch (shards staged on their towers'
devices ahead of the step).

May import: towers.multi_worker, towers.engine, towers.placement, the three
techniques and the shared modules. Never towers.cli.
"""
