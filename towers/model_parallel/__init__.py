"""Model parallelism: the model cut into pipeline stages, each on its own device.

stages (`split_model`, cutting a Keras model after named layers; placing each
stage's variables and optimizer slots), schedule (GPipe and 1F1B: the order of
each stage's forwards and backwards per micro-batch, as a timetable). A tower
runs its stages in data_parallel.tower; a grid of towers x stages is the step's.

May import: towers.devices, towers.errors. Nothing else of towers.
"""
