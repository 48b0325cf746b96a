"""The benchmarks' shared code; the entry points (one per measurement, each the only
file with flags) are the scripts at the top of benchmarks/.

compare (run_benchmark: every mode on one batch, timed interleaved), pipeline
(run_pipeline_benchmark: stages x micro-batches) and op_parallel
(run_op_parallel_benchmark: a transformer block split into T parts) are the
harnesses; they time with measure.time_interleaved and read traces with traces.
mode (the Mode interface), modes (towers, plain, Keras fit and the floor, by
name), baselines (no-exchange towers, MirroredStrategy), bare (the floor: the
seven steps written plainly), model_setup (the model to benchmark and its
batch), phases and pipeline_profile (what a trace says, per phase and per
stage), report (the outputs), child_process (a configuration in a fresh
process, for its memory).
"""
