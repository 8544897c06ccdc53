"""What keeps a run honest across workers: the non-finite policies and checks
(:mod:`.nonfinite`), the settings digest every worker compares (:mod:`.consistency`),
replicas broadcast and compared (:mod:`.replicas`), and the refusal of a gradzip optimizer
that DDP also synchronises (:mod:`.double_sync`). Below the exchange: it uses comm only."""
