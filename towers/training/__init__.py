"""The trainer: the step compiled, fed and looped.

trainer (`TowerTrainer`: options, checks, calling the compiled step), placement
(its devices as a grid of towers x stages or parts: the step's set-up), compiled_steps (the bodies it compiles: the train step, steps 1-7, and the
eval step), first_batch (building and checking on the first batch), compiled
(one tf.function per batch structure), executions (several steps per call, an
in-graph loop), loop (`fit`, `evaluate`, progress, summaries), metrics,
callbacks (Keras callbacks), checkpoint (`Checkpointer`), preemption
(SIGTERM/SIGINT finish the step and save), prefetch (shards staged on their
towers' devices ahead of the step).

May import: towers.multi_worker, towers.op_parallel, towers.data_parallel,
towers.model_parallel, towers.devices, towers.errors. Never towers.cli.
"""
