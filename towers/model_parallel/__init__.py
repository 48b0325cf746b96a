"""Model parallelism: the model cut into pipeline stages, each on its own device.

stages (`split_model`, cutting a Keras model after named layers; `Stages`, each
stage's variables), schedule (GPipe and 1F1B: the order of each stage's forwards and
backwards per micro-batch, as a timetable), flight (`Flight`: a tower's
micro-batches through its stages in the schedule's order; what each stage computes,
its forward and the loss, is given to it by the engine, engine/tower.py).

May import: the shared modules only (gradients, compat).
"""
