"""The train stage's room: the driver (``driver.py``: checks, draft vocabulary, Ray Train launch),
what it hands each worker (``job.py``), the worker's loop (``loop.py``) and a step's pieces
(``worker.py``), checkpoints (``state.py``), what a worker reads (``data.py`` for the cache,
``sources.py`` for either source), online and hybrid training (``modes.py``) and the trainer's
held-out tau beside the served one (``vs_serve.py``)."""
