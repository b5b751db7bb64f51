"""Run a plan on the real model: the interpreter of the planned order (:mod:`.interpreter`), the
planned CPU allocator (:mod:`.allocator`, ``csrc/``) and its record/place/replay driver
(:mod:`.replay`), rematerialised steps (:mod:`.remat`) and measured op costs (:mod:`.profile`)."""
