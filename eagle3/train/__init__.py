"""The train stage: the drafter (architecture only), the training-time test, the draft vocabulary, the Accelerate loop."""
