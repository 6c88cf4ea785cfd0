"""Auto: a bandit over the other methods, timed on the machine at hand (``drafter``), and the profile of rates it keeps per target (``profile``)."""
