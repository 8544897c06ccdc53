"""gradzip codecs inside ``torch.nn.parallel.DistributedDataParallel``: communication hooks
(docs/ddp.md is the guide). PyTorch style, a state plus a function for
``DistributedDataParallel.register_comm_hook(state, hook)``:

* :func:`hook` / :class:`CodecState` + :func:`codec_hook` (:mod:`.codec`): any gradzip
  codec, error feedback on for biased codecs and off for unbiased ones;
* :class:`PowerSGDState` + :func:`powersgd_hook` (:mod:`.powersgd`): PyTorch's two-round
  PowerSGD, its options and ``Q`` draws.

Both keep their state by parameter, not by bucket, so it survives DDP's bucket rebuild and
a restore into a new DDP instance; ``state_dict()`` holds tensors and plain values only
(``torch.load``'s defaults load it); both issue their collectives in bucket order from the
hook's thread; both take ``nonfinite`` (``"raise"`` by default, ``"skip"``, ``"off"``) as the
optimizers do (:mod:`.state`).
"""
from .codec import CodecState, codec_hook, hook
from .powersgd import PowerSGDState, powersgd_hook
from .state import HookState

__all__ = ["CodecState", "codec_hook", "hook", "PowerSGDState", "powersgd_hook", "HookState"]
