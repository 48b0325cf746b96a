"""Several machines: the towers of every worker joined into one step.

cluster (`Cluster`, joining TensorFlow's collective runtime, the start-up
checks), watchdog (pings the peers while a step runs; a lost worker ends the
step on every worker), launch (several local workers on 127.0.0.1 ports, run as
a file: it imports neither TensorFlow nor towers). The all-reduces themselves
are data_parallel's (exchange, collectives).

May import: towers.data_parallel, towers.devices, towers.errors.
"""
