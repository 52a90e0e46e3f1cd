"""Training EAGLE-3 heads for a target on the target's own answers (`specserve train-eagle`)."""
