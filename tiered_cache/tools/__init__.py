"""Applications built on the library: the `tiered-cache` command line, the capacity planner,
trace replay, the synthetic workload generators and the main job.

Nothing in the library imports this package. It is the only place that uses matplotlib and
tqdm (the `tools` extra, installed from the source tree: `errors.install_hint`), and even here
they are imported on first use through `tiered_cache.tools.extras`, so `tiered-cache plan`
runs without them.
"""
