"""``engine=hf``: evaluation in this process (:mod:`eagle3.evaluate.inprocess.backend`)."""
