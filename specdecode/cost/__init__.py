"""Facts about the runtime on this machine that decisions are made from: the cost profile
(what scoring n tokens and drafting cost, measured and cached per machine) and the speedup
theory that turns acceptance and costs into expected speedups. ``control/`` and the engine
use them; reporting (``analysis/``, ``bench/``) sits above and nothing here imports it."""
