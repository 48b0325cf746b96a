"""Example programs and models; a package so that `--model=examples.my_model:small_cnn` imports."""
