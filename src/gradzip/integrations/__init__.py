"""gradzip inside other training frameworks' own collectives (PyTorch FSDP2: :mod:`.fsdp`)."""
