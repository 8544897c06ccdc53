"""gradzip inside the frameworks users train with: DDP communication hooks (:mod:`.ddp`),
FSDP2 and HSDP (:mod:`.fsdp`), Lightning strategies (:mod:`.lightning`), the Accelerate
helpers (:mod:`.accelerate`). Each framework is imported by its own module only; the short
public names are ``gradzip.integrations.ddp``, ``gradzip.integrations.fsdp``, ``gradzip.integrations.lightning`` and
``gradzip.integrations.accelerate``."""
