"""What every method shares, the machinery below the algorithm boxes: the optimizer base and
its step skeleton (:mod:`.base`), what the workers agree on (:mod:`.agreement`), which
parameters take part (:mod:`.participation`), the
exchanges a method owns (:mod:`.exchanges`), the options and their checks (:mod:`.options`),
the non-finite guard and undo log (:mod:`.guard`), the exchange during backward
(:mod:`.overlap`) and its gradient fingerprint (:mod:`.fingerprint`), torch's optimizer
without its dynamo import (:mod:`.eager`), learning-rate schedules (:mod:`.schedule`) and
codecs chosen from a target ratio (:mod:`.ratios`)."""
