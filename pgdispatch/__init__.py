"""pgdispatch: the command line and the demo, on top of ``webapp``, ``scheduler`` and ``sql``."""
