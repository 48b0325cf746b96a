"""The command line: `towers-train` (`python -m towers.train`).

train (the flags, read into a Job), job (the run a Job describes, from plain
values: data, model, trainer, fit, the final metrics), plans (--split_plan and the built-in
models' op-parallel plans), model_spec (--model: a built-in
name, PACKAGE.MODULE:FUNCTION or PATH.keras), models (the built-in mlp, cnn,
resnet and text models), data (--dataset: the data sets, their splits and
tf.data pipelines), arrays (checking and converting their arrays), data_files
(downloads and .npz files, never unpickled).

May import anything in towers; nothing in towers imports it (towers/__init__
only aliases its modules' old paths).
"""
