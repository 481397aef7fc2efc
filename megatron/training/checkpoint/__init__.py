"""Checkpoints: the save protocol and the order of a resume (:mod:`.save_load`), the two
formats (:mod:`.torch_format`, :mod:`.torch_dist_format`), what ``--load`` loads
(:mod:`.discovery`), digests (:mod:`.integrity`), the ``--save`` guards (:mod:`.save_guard`,
:mod:`.lock`) and what a checkpoint holds besides the model (RNG, quantization state)."""
