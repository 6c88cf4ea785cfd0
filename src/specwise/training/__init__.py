"""Training machinery shared by every trainable drafter: corpus, target features, trainer, checkpoints."""
